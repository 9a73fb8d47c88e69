"""Qwen3.5's bad-input lines: one clear line each, all at once, from ``validate``'s checks (no processes, no
weights). Qwen3.5's config.json adds the hybrid layer pattern and the Gated DeltaNet head counts."""

from __future__ import annotations

import copy
import json

import pytest

from mimo_sft.config.loader import load_config
from mimo_sft.validate import check_config

PATTERN = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
QWEN3_5 = {"model_type": "qwen3_5", "tie_word_embeddings": True,
           "text_config": {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
                           "hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "vocab_size": 1024,
                           "layer_types": PATTERN, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                           "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
           "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                             "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                             "temporal_patch_size": 2, "num_position_embeddings": 64}}


def _problems(tmp_path, config: dict, *components: str, extra=()) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--hf-model", str(tmp_path), "--allow-random-init", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--gpu-memory-gb", "100000", *extra]
    for c in components:
        args += ["--component", c]
    return [str(p) for p in check_config(load_config(args)).problems]


def _text(**changes) -> dict:
    config = copy.deepcopy(QWEN3_5)
    config["text_config"].update(changes)
    return config


def test_a_qwen3_5_folder_passes(tmp_path):
    assert _problems(tmp_path, QWEN3_5, "language=dp=2", "images=dp=2,rank_offset=2") == []
    assert _problems(tmp_path, QWEN3_5, "language=tp=2,dp=1", "images=dp=1,rank_offset=2",
                     extra=["--model-family", "qwen3_5"]) == []
    # a stage boundary may fall inside the 3:1 pattern (the layer spec is built per stage)
    assert _problems(tmp_path, QWEN3_5, "language=pp=4,dp=1", "images=dp=1,rank_offset=4") == []
    # without layer_types transformers derives the 3:1 pattern: nothing to refuse
    no_types = copy.deepcopy(QWEN3_5)
    del no_types["text_config"]["layer_types"]
    assert _problems(tmp_path, no_types, "language=dp=1", "images=dp=1,rank_offset=1") == []


def test_every_bad_input_is_one_line_all_at_once(tmp_path):
    """tp=4 divides the 8 attention heads only; the layer pattern is short and names an unknown kind."""
    config = _text(linear_num_value_heads=5, layer_types=["linear_attention", "mamba", "full_attention"])
    probs = _problems(tmp_path, config, "language=tp=4,dp=1", "images=dp=1,rank_offset=4")
    expected = [
        "[16] language.tp=4 does not divide the model's 2 key/value heads; choose a divisor of 2",
        "[16] language.tp=4 does not divide the model's 2 Gated DeltaNet key heads (text_config.linear_num_key_heads); "
        "choose a divisor of 2",
        "[16] language.tp=4 does not divide the model's 5 Gated DeltaNet value heads "
        "(text_config.linear_num_value_heads); choose a divisor of 5",
        "[16] config.json text_config.layer_types: it lists 3 entries for text_config.num_hidden_layers=4; unknown "
        "entries 'mamba' at layer 1; list exactly one of 'linear_attention' or 'full_attention' per layer (or drop "
        "layer_types for the 3:1 pattern)",
        "[16] config.json text_config.linear_num_value_heads=5 is not a multiple of text_config.linear_num_key_heads=2; "
        "the Gated DeltaNet groups value heads evenly over key heads",
    ]
    assert probs == expected, probs


@pytest.mark.parametrize("types, fragment", [
    (PATTERN[:3], "it lists 3 entries for text_config.num_hidden_layers=4;"),
    (PATTERN[:3] + ["sliding_attention"], "unknown entries 'sliding_attention' at layer 3;"),
    ("linear_attention", "it is a str, not a list;"),
])
def test_layer_types_line_names_the_key_and_the_fix(tmp_path, types, fragment):
    probs = _problems(tmp_path, _text(layer_types=types), "language=dp=1", "images=dp=1,rank_offset=1")
    assert len(probs) == 1 and probs[0].startswith("[16] config.json text_config.layer_types: "), probs
    assert fragment in probs[0] and "per layer" in probs[0], probs


def test_the_builder_asserts_the_same_rules():
    """``layout_problems`` (what model.builder asserts away) carries the family rules check 16 reports."""
    from mimo_sft.config import families
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.layout import Layout

    specs = [parse_component("language=tp=2,dp=1"), parse_component("images=dp=1,rank_offset=2")]
    layout = Layout.from_specs(specs, 3)
    assert families.layout_problems(families.QWEN3_5, layout, QWEN3_5) == []
    bad = _text(linear_num_key_heads=3, layer_types=PATTERN + PATTERN)
    out = families.layout_problems(families.QWEN3_5, layout, bad)
    assert [p.split(" ")[0] for p in out] == ["language.tp=2", "config.json", "config.json"], out
    assert "3 Gated DeltaNet key heads" in out[0] and "8 entries" in out[1] and "not a multiple" in out[2]


def test_qwen3_5_moe_folders_are_checked_for_gdn_heads_and_experts(tmp_path):
    """Qwen3.5-MoE (no dense MLP: no intermediate_size) passes, and its GDN heads and experts are divided."""
    text = {k: v for k, v in QWEN3_5["text_config"].items() if k != "intermediate_size"}
    moe = dict(QWEN3_5, model_type="qwen3_5_moe",
               text_config=dict(text, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                shared_expert_intermediate_size=64))
    assert _problems(tmp_path, moe, "language=dp=2,ep=2", "images=dp=1,rank_offset=2") == []
    probs = _problems(tmp_path, moe, "language=dp=3,ep=3", "images=dp=1,rank_offset=3")
    assert any("language.ep=3 does not divide the model's 8 experts" in p for p in probs), probs
    probs = _problems(tmp_path, dict(moe, text_config=dict(moe["text_config"], linear_num_key_heads=3)),
                      "language=tp=2,dp=1", "images=dp=1,rank_offset=2", extra=["--sequence-parallel"])
    assert any("3 Gated DeltaNet key heads" in p for p in probs), probs