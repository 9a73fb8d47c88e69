"""Qwen3-VL-MoE sizes: the preset against transformers' meta model, the forecast's per-rank counts against a
built model, the sparse layer's saved-for-backward bytes measured at the real width, the active FLOPs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mimo_sft.memory import activations as act
from mimo_sft.memory.dims import (TextDims, VisionDims, expert_params, language_active_params, language_params,
                                  language_stage_expert_params, language_stage_params, vision_params)


@pytest.fixture(scope="module")
def preset_30b(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint

    return write_preset_checkpoint(tmp_path_factory.mktemp("p30b") / "m", "qwen3-vl-30b-a3b")


def test_preset_is_30b_total_and_3b_active_as_transformers_counts(preset_30b):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    cfg = Qwen3VLMoeConfig.from_pretrained(preset_30b)
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    count = sum(p.numel() for p in model.parameters())
    hf = json.loads((preset_30b / "config.json").read_text())
    d = TextDims.from_config(hf)
    assert (d.experts, d.topk, d.expert_ffn, len(d.sparse)) == (128, 8, 768, 48)
    assert language_params(d) + sum(vision_params(VisionDims.from_config(hf))) == count
    assert 30e9 <= count < 32e9, count  # "30B": the decoder's 30.5B and the 0.5B tower
    active = language_active_params(d)
    assert 3e9 <= active < 3.5e9, active  # "A3B"
    # the MFU figure's weights: every linear once, each sparse layer's router and 8 of its 128 experts
    from mimo_sft.train.flops import language_matmul_params

    t = cfg.text_config
    linears = sum(p.numel() for n, p in model.model.language_model.named_parameters()
                  if n.endswith(("proj.weight", "gate.weight")) or "experts" in n)
    inactive = 48 * (128 - 8) * 3 * t.hidden_size * t.moe_intermediate_size
    assert language_matmul_params(t) == linears - inactive + t.hidden_size * t.vocab_size


def test_per_rank_counts_follow_ep_and_etp(preset_30b):
    d = TextDims.from_config(json.loads((preset_30b / "config.json").read_text()))
    one = language_stage_params(d, tp=1, pp=1, stage=0)
    experts = language_stage_expert_params(d, tp=1, pp=1, stage=0)
    assert experts == 48 * expert_params(d) and experts > 0.9 * one
    for ep, etp, tp in ((8, 1, 2), (4, 2, 2), (16, 1, 1)):
        got = language_stage_params(d, tp=tp, pp=1, stage=0, ep=ep, etp=etp)
        dense = language_stage_params(d, tp=tp, pp=1, stage=0, ep=128, etp=1) - 48 * expert_params(d, ep=128)
        assert got == dense + 48 * d.experts // ep * 3 * d.hidden * (d.expert_ffn // etp)


def test_tiny_built_model_has_the_forecast_counts(tmp_path):
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path / "m", family="qwen3_vl_moe", text_layers=3)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["mlp_only_layers"] = [1]  # a dense layer between two sparse ones
    (out / "config.json").write_text(json.dumps(cfg))
    model, _ = build_single_process_model(str(out), random_init=True)
    d = TextDims.from_config(cfg)
    assert d.sparse == frozenset({0, 2})
    kinds = [type(layer.mlp).__name__ for layer in model.language_model.decoder.layers]
    assert kinds == ["MoELayer", "MLP", "MoELayer"], kinds
    assert sum(p.numel() for p in model.language_model.parameters()) == language_stage_params(d, tp=1, pp=1, stage=0)


@pytest.mark.parametrize("shape", ["real_30b_a3b", "other", "qwen3_5_moe_gdn", "qwen3_5_moe_attention"])
def test_sparse_layer_saved_bytes_match_the_formula(preset_30b, tmp_path, shape):
    """One sparse decoder layer's saved-for-backward bytes (``testing.saved_bytes``: the layer as the builder
    builds it, bf16, CUDA's fused norms, a random router) against ``memory.activations`` at Qwen3-VL-30B-A3B's
    width (2048 hidden, 128 experts of 768, top 8), at another shape (fewer, wider experts, top 3), and for
    Qwen3.5-MoE's two layer kinds with their gated shared expert (at 1024 wide: 397B-A17B's own layer would
    take 6 GB): within 1 %."""
    from mimo_sft.testing import saved_bytes as sb
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint

    folder, kind = preset_30b, None
    if shape.startswith("qwen3_5_moe"):
        folder = write_preset_checkpoint(tmp_path / "q35", "qwen3.5-397b-a17b")
        cfg = json.loads((folder / "config.json").read_text())
        cfg["text_config"].update(hidden_size=1024, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512,
                                  shared_expert_intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, linear_num_value_heads=32,
                                  layer_types=["linear_attention"] * 3 + ["full_attention"])
        cfg["vision_config"]["out_hidden_size"] = 1024
        (folder / "config.json").write_text(json.dumps(cfg))
        kind = "full_attention" if shape.endswith("attention") else "linear_attention"
    if shape == "other":
        cfg = json.loads((preset_30b / "config.json").read_text())
        cfg["text_config"].update(num_local_experts=24, num_experts_per_tok=3, moe_intermediate_size=1536,
                                  hidden_size=1024, num_attention_heads=16, num_key_value_heads=4)
        cfg["vision_config"]["out_hidden_size"] = 1024
        folder = tmp_path / "other"
        folder.mkdir()
        for f in preset_30b.iterdir():
            if f.is_file():
                (folder / f.name).write_bytes(f.read_bytes())
        (folder / "config.json").write_text(json.dumps(cfg))
    block, lcfg = sb.language_layer(str(folder), dtype=torch.bfloat16, layer_type=kind)
    assert type(block.layers[0].mlp).__name__ == "MoELayer"
    tokens = 256
    got = sb.language_layer_saved(block, lcfg, tokens, dtype=torch.bfloat16, device="cuda")
    d = TextDims.from_config(json.loads((folder / "config.json").read_text()))
    assert d.shared_ffn == (768 if kind else 0)
    want = sum(act.language_layer_terms(d, tp=1, sp=False, b=2, device="cuda", index=0,
                                        layer_type=kind or "full_attention").values()) * tokens
    assert math.isclose(got, want, rel_tol=0.01), (got, want)


def test_qwen3_5_397b_preset_is_397b_total_and_17b_active_as_transformers_counts():
    """The preset as Megatron-Bridge's provider states the model (60 hybrid layers, 512 experts, top 10, one
    shared): transformers' meta model has the forecast's count, 396.8B (the name rounds), 17.3B of it active."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from mimo_sft.testing.tiny_checkpoint import preset_config
    from mimo_sft.train.flops import language_matmul_params

    cfg = preset_config("qwen3.5-397b-a17b")
    assert type(cfg) is Qwen3_5MoeConfig
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    count = sum(p.numel() for p in model.parameters())
    hf = cfg.to_dict()
    d = TextDims.from_config(hf)
    assert (d.experts, d.topk, d.expert_ffn, d.shared_ffn, len(d.sparse)) == (512, 10, 1024, 1024, 60)
    assert language_params(d) + sum(vision_params(VisionDims.from_config(hf))) == count
    assert round(count / 1e9) == 397 and round(language_active_params(d) / 1e9) == 17
    t = cfg.text_config
    inactive = 60 * (512 - 10) * 3 * t.hidden_size * t.moe_intermediate_size
    linears = sum(p.numel() for n, p in model.model.language_model.named_parameters()
                  if "norm" not in n and "embed" not in n and not n.endswith(("A_log", "dt_bias")))
    assert language_matmul_params(t) == linears - inactive + t.hidden_size * t.vocab_size
