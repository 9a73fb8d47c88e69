"""Expert parallelism's bad-input lines: one clear line each from ``validate``'s checks (no processes)."""

from __future__ import annotations

import json

import pytest

from mimo_sft.config.loader import load_config
from mimo_sft.validate import check_config

QWEN3_VL_MOE = {"model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
                "text_config": {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
                                "hidden_size": 64, "intermediate_size": 128, "head_dim": 32, "vocab_size": 1024,
                                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
                "vision_config": {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                  "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                                  "temporal_patch_size": 2, "num_position_embeddings": 64,
                                  "deepstack_visual_indexes": [0, 1]}}
QWEN3_VL = dict(QWEN3_VL_MOE, model_type="qwen3_vl",
                text_config={k: v for k, v in QWEN3_VL_MOE["text_config"].items()
                             if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")})


def _problems(tmp_path, config: dict, *components: str, extra=()) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--hf-model", str(tmp_path), "--allow-random-init", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--gpu-memory-gb", "100000", *extra]
    for c in components:
        args += ["--component", c]
    return [str(p) for p in check_config(load_config(args)).problems]


@pytest.mark.parametrize("components, extra", [
    (("language=dp=4,ep=4", "images=dp=2,rank_offset=4"), ()),
    (("language=dp=2,ep=2", "images=dp=2,rank_offset=2"), ()),
    (("language=tp=2,dp=2,ep=2", "images=tp=2,dp=2"), ("--sequence-parallel",)),  # colocated, etp = tp = 2
    (("language=tp=2,dp=2,ep=4,etp=1", "images=dp=2,rank_offset=4"), ("--sequence-parallel", "--moe-aux-loss-coeff", "0.01")),
])
def test_expert_layouts_pass(tmp_path, components, extra):
    assert _problems(tmp_path, QWEN3_VL_MOE, *components, extra=extra) == []


@pytest.mark.parametrize("config, components, extra, expected", [
    (QWEN3_VL_MOE, ("language=dp=3,ep=3", "images=dp=1,rank_offset=3"), ("--micro-batch-size", "3", "--global-batch-size", "3"),
     "[16] language.ep=3 does not divide the model's 8 experts (text_config.num_experts); choose a divisor of 8"),
    (QWEN3_VL_MOE, ("language=dp=2,ep=4", "images=dp=2,rank_offset=2"), (),
     "[12] language.ep=4 x etp=1 does not divide the 2 ranks of a language pipeline stage (tp*cp*dp = 1*1*2); "
     "choose ep and etp whose product divides it"),
    (QWEN3_VL_MOE, ("language=dp=2", "images=dp=2,ep=2,rank_offset=2"), (),
     "[12] images.ep=2: expert parallelism is for the language model's experts (the images encoder has "
     "none); set ep=1 and drop etp on images"),
    (QWEN3_VL, ("language=dp=2,ep=2", "images=dp=2,rank_offset=2"), (),
     "[16] language.ep=2: qwen3_vl is a dense model (no experts); set ep=1 and drop etp"),
    (QWEN3_VL_MOE, ("language=dp=2", "images=dp=2,rank_offset=2"), ("--moe-aux-loss-coeff", "-0.1"),
     "[01] --moe-aux-loss-coeff=-0.1 must be >= 0 (0: no load-balancing loss)"),
    (QWEN3_VL_MOE, ("language=tp=2,dp=2,ep=2", "images=dp=2,rank_offset=4"), (),
     "[16] language.tp=2 with a mixture-of-experts model needs --sequence-parallel (megatron's MoE layer refuses "
     "tensor parallelism without it); add --sequence-parallel"),
    (QWEN3_VL_MOE, ("language=tp=2,dp=2,etp=2,ep=1", "images=dp=2,rank_offset=4"),
     ("--sequence-parallel",), None),
    (QWEN3_VL_MOE, ("language=dp=2,ep=2", "images=dp=2,rank_offset=2"),
     ("--moe-aux-loss-coeff", "0.01", "--recompute-granularity", "selective"),
     "[16] --moe-aux-loss-coeff=0.01 with --recompute-granularity selective: a recomputed layer would weigh its "
     "load-balancing loss by another micro-batch's tokens (train.expert_load); drop one of the two"),
    (QWEN3_VL_MOE, ("language=cp=2,dp=1,ep=2", "images=dp=2"), ("--moe-aux-loss-coeff", "0.01"), None),
    (QWEN3_VL_MOE, ("language=tp=2,cp=2,dp=1,ep=2", "images=dp=4"), ("--moe-aux-loss-coeff", "0.01",
                                                                     "--sequence-parallel"), None),
])
def test_bad_expert_layouts_are_one_line_each(tmp_path, config, components, extra, expected):
    probs = _problems(tmp_path, config, *components, extra=extra)
    if expected is None:
        assert probs == []
        return
    assert expected in probs, probs
    assert all("\n" not in p for p in probs)


def test_etp_must_divide_the_expert_width(tmp_path):
    cfg = json.loads(json.dumps(QWEN3_VL_MOE))
    cfg["text_config"]["moe_intermediate_size"] = 50
    probs = _problems(tmp_path, cfg, "language=tp=4,dp=1", "images=dp=1,rank_offset=4",
                      extra=("--sequence-parallel",))
    assert ("[16] language.etp=4 does not divide the experts' FFN width 50 (text_config.moe_intermediate_size); "
            "choose a divisor (etp defaults to tp)") in probs, probs


def test_a_router_picking_more_experts_than_exist_is_refused(tmp_path):
    cfg = json.loads(json.dumps(QWEN3_VL_MOE))
    cfg["text_config"]["num_experts_per_tok"] = 9
    probs = _problems(tmp_path, cfg, "language=dp=2", "images=dp=2,rank_offset=2")
    assert any("text_config.num_experts_per_tok=9 must be between 1 and text_config.num_experts=8" in p
               for p in probs), probs
