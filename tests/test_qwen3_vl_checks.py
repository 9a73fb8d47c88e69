"""Qwen3-VL's bad-input lines: one clear line each, from ``validate``'s checks (no processes, no weights)."""

from __future__ import annotations

import json

import pytest

from mimo_sft.validate import check_config
from mimo_sft.config.loader import load_config
from mimo_sft.errors import UserError

QWEN3_VL = {"model_type": "qwen3_vl", "tie_word_embeddings": True,
            "text_config": {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
                            "hidden_size": 64, "intermediate_size": 128, "head_dim": 32, "vocab_size": 1024},
            "vision_config": {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "num_position_embeddings": 64,
                              "deepstack_visual_indexes": [0, 1]}}
NON_COLOCATED = ("language=dp=2", "images=dp=2,rank_offset=2")


def _problems(tmp_path, config: dict, *components: str, extra=()) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--hf-model", str(tmp_path), "--allow-random-init", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--gpu-memory-gb", "100000", *extra]
    for c in components:
        args += ["--component", c]
    return [str(p) for p in check_config(load_config(args)).problems]


def test_a_qwen3_vl_folder_passes(tmp_path):
    assert _problems(tmp_path, QWEN3_VL, *NON_COLOCATED) == []
    assert _problems(tmp_path, QWEN3_VL, *NON_COLOCATED, extra=["--model-family", "qwen3_vl"]) == []


@pytest.mark.parametrize("folder, family, expected", [
    ("qwen3_vl", "qwen2_5_vl", "--model-family qwen2_5_vl does not match --hf-model {dir}/config.json "
                               "(model_type 'qwen3_vl' is family qwen3_vl); pass --model-family auto or qwen3_vl"),
    ("qwen2_5_vl", "qwen3_vl", "--model-family qwen3_vl does not match --hf-model {dir}/config.json "
                               "(model_type 'qwen2_5_vl' is family qwen2_5_vl); pass --model-family auto or qwen2_5_vl"),
])
def test_model_family_must_match_the_folder(tmp_path, folder, family, expected):
    config = dict(QWEN3_VL, model_type=folder)
    probs = _problems(tmp_path, config, *NON_COLOCATED, extra=["--model-family", family])
    assert probs == [f"[30] {expected.format(dir=tmp_path)}"], probs


def test_later_qwen_generations_are_named_as_not_yet_supported(tmp_path, monkeypatch):
    """A model_type mimo-sft knows of but cannot build is named in one line with what it is."""
    from mimo_sft.config import families
    from mimo_sft.model.registry import get_family

    monkeypatch.setitem(families.NOT_YET_SUPPORTED, "qwen9_vl", "Qwen9-VL (a later generation)")
    probs = _problems(tmp_path, dict(QWEN3_VL, model_type="qwen9_vl"), *NON_COLOCATED)
    line = [p for p in probs if "qwen9_vl" in p]
    assert len(line) == 1 and "model_type 'qwen9_vl' is Qwen9-VL (a later generation)" in line[0], probs
    assert "not yet supported by mimo-sft; supported model types: qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_vl_moe" in line[0]
    with pytest.raises(UserError, match="'qwen9_vl' is Qwen9-VL.*not yet supported.*qwen2_5_vl, qwen3_vl, qwen3_5"):
        get_family({"model_type": "qwen9_vl"}, hf_dir="M")


def test_family_limits_images_tp_and_full_recompute(tmp_path):
    probs = _problems(tmp_path, QWEN3_VL, "language=dp=2", "images=tp=2,dp=1,rank_offset=2")
    assert any("[10] images.tp=2: the Hugging Face Qwen3-VL vision tower runs unsharded" in p for p in probs), probs
    # colocated: images tp replicates the tower (fan-out), a note, not an error
    assert _problems(tmp_path, QWEN3_VL, "language=dp=2", "images=tp=2,dp=1") == []
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    # DeepStack under megatron's re-entrant full recomputation is exact (tests/test_deepstack_model.py)
    assert _problems(tmp_path, QWEN3_VL, *NON_COLOCATED, extra=full) == []
    sel = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn,mlp"]
    assert _problems(tmp_path, QWEN3_VL, *NON_COLOCATED, extra=sel) == []
