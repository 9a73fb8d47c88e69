"""The memory forecast's Qwen3.5 activation terms, against what autograd saves in one real-width layer.

Qwen3.5-27B's two layer kinds (``testing.saved_bytes``, bf16, width 5120): a Gated DeltaNet layer, whose
three fla kernels keep what fla's autograd Functions keep (``saved_bytes.fla_saved_tensors``: on the CPU the
layer runs torch stand-ins), and a gated full-attention layer (output gate, q/k norms, partial rotary). Each
layer's bytes equal the formula exactly, less only the zero-centred norms' per-layer ``1 + w`` tables; the
recompute settings move what they should (``core_attn`` leaves a GDN layer alone). Then the forecast: each
pipeline stage sums its own layers by kind, and ``validate`` forecasts a 27B pipeline layout from config.json.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from mimo_sft.config.checks.context import read_hf_config
from mimo_sft.memory import activations as act
from mimo_sft.memory.dims import FULL_ATTENTION as FULL, LINEAR_ATTENTION as LIN, TextDims

TOKENS = 256
#: the layers are measured on the CPU's dispatch path (Qwen3.5's norms keep less on CUDA's: test_memory_devices)
CPU = "cpu"


@pytest.fixture(scope="module")
def q35_27b(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import preset_config

    out = tmp_path_factory.mktemp("q35_27b")
    preset_config("qwen3.5-27b").save_pretrained(str(out))  # config.json only
    return str(out)


def _tables(d: TextDims, kind: str) -> int:
    """The fp32 ``1 + w`` each zero-centred RMSNorm keeps: per layer (two norms, and attention's q/k norms)."""
    return act.FP32 * (2 * d.hidden + (2 * d.head_dim if kind == FULL else 0))


def _measure(hf_dir: str, kind: str, recompute: dict | None = None) -> int:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    from mimo_sft.testing import saved_bytes as sb

    block, cfg = sb.language_layer(hf_dir, dtype=torch.bfloat16, layer_type=kind, recompute=recompute)
    assert isinstance(block.layers[0].self_attention, GatedDeltaNet if kind == LIN else SelfAttention)
    return sb.language_layer_saved(block, cfg, TOKENS, dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", [LIN, FULL])
def test_27b_layer_bytes_equal_the_formula(q35_27b, kind):
    """~64 h (GDN) and ~67 h (full attention) bytes per token at tp 1 with the fused SwiGLU (~78 h and ~81 h
    without); each term as activations.py lists it."""
    d = TextDims.from_config(read_hf_config(q35_27b))
    assert d.rotary_dim == d.head_dim // 4 and d.gdn.value_heads == 48
    terms = act.language_layer_terms(d, tp=1, sp=False, b=2, device=CPU, layer_type=kind)
    assert ("delta rule" in terms) == (kind == LIN) and ("output gate" in terms) == (kind == FULL)
    measured = _measure(q35_27b, kind)
    assert measured == round(sum(terms.values()) * TOKENS) + _tables(d, kind), (measured, sum(terms.values()))


def test_27b_recompute_settings(q35_27b):
    """Selective core_attn recomputes attention's core only: the GDN layer saves exactly what it saves without
    it, the attention layer drops its log-sum-exp. mlp drops the MLP's tensors; full recomputation keeps the
    layer's input."""
    d = TextDims.from_config(read_hf_config(q35_27b))
    core = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    mlp = {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    for kind in (LIN, FULL):
        terms = act.language_layer_terms(d, tp=1, sp=False, b=2, device=CPU, recompute_modules=("core_attn",),
                                         layer_type=kind)
        # megatron hands the mask type through its checkpoint as a one-element int32 tensor (attention.py)
        mask_type = 4 if kind == FULL else 0
        assert _measure(q35_27b, kind, core) == round(sum(terms.values()) * TOKENS) + _tables(d, kind) + mask_type, kind
    plain = act.language_layer_terms(d, tp=1, sp=False, b=2, device=CPU, layer_type=LIN)
    assert act.language_layer_terms(d, tp=1, sp=False, b=2, device=CPU, recompute_modules=("core_attn",),
                                    layer_type=LIN) == plain
    terms = act.language_layer_terms(d, tp=1, sp=False, b=2, device=CPU, recompute_modules=("mlp",), layer_type=LIN)
    assert terms["mlp"] == 0 and _measure(q35_27b, LIN, mlp) == round(sum(terms.values()) * TOKENS) + _tables(d, LIN)
    assert _measure(q35_27b, LIN, full) == act.language_layer_input(d, tp=1, sp=False, b=2) * TOKENS


def test_fla_measurement_functions_keep_flas_tensors_and_return_the_stand_ins_outputs():
    """The three measurement Functions: outputs equal to the torch stand-ins', and the bytes they keep are
    fla 0.4's ``save_for_backward`` lists (conv: its input; l2norm: output and fp32 per-row rstd; the rule:
    q, k, v, beta as given, fp32 g and bf16 A [B, T, H, 64])."""
    from mimo_sft.model import gdn_kernels as gk
    from mimo_sft.testing import saved_bytes as sb

    gen = torch.Generator().manual_seed(0)
    B, T, H, K, D = 1, 80, 4, 16, 24

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(True)

    qkvz = rand(B, T, 2 * H * K + 2 * H * D)
    x = qkvz[..., : 2 * H * K + H * D]  # the conv's input: a view of in_proj's output
    w = torch.randn(2 * H * K + H * D, 4, generator=gen).to(torch.bfloat16)
    kept, y = sb.saved_bytes(lambda t: sb._fla_conv(t, w, activation="silu")[0], x, exclude=[w])
    assert torch.equal(y, gk.causal_conv1d(x.detach(), w, activation="silu")[0]) and kept == qkvz.numel() * 2

    qk = rand(B, T, 2 * H, K)
    kept, y = sb.saved_bytes(sb._fla_l2norm, qk)
    assert torch.equal(y, gk.l2norm(qk.detach())) and kept == qk.numel() * 2 + B * T * 2 * H * 4

    q, k, v, beta = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, D), rand(B, T, H).detach().sigmoid()
    g = -torch.rand(B, T, H, generator=gen).requires_grad_(True)
    kept, (o, _) = sb.saved_bytes(sb._fla_chunk_rule, q, k, v, g, beta)
    ref, _ = gk.chunk_gated_delta_rule(q.detach(), k.detach(), v.detach(), g.detach(), beta)
    assert o.dtype == q.dtype and torch.equal(o, ref.to(q.dtype))
    assert kept == 2 * (q.numel() + k.numel() + v.numel() + beta.numel()) + 4 * g.numel() + 2 * B * T * H * 64


def test_without_the_fla_functions_the_stand_ins_would_be_counted(tmp_path):
    """Why the swap: autograd keeps the torch stand-ins' chunk intermediates (fp32 copies, per-chunk matrices),
    far more than fla keeps; the measurement must not count them (0.8B width, 128 tokens)."""
    from mimo_sft.testing import saved_bytes as sb
    from mimo_sft.testing.tiny_checkpoint import preset_config

    preset_config("qwen3.5-0.8b").save_pretrained(str(tmp_path))
    d = TextDims.from_config(read_hf_config(str(tmp_path)))
    block, cfg = sb.language_layer(str(tmp_path), dtype=torch.bfloat16, layer_type=LIN)
    fla = sb.language_layer_saved(block, cfg, 128, dtype=torch.bfloat16)
    terms = act.language_layer_terms(d, tp=1, sp=False, b=2, device=CPU, layer_type=LIN)
    assert fla == round(sum(terms.values()) * 128) + _tables(d, LIN)
    swap = sb.fla_saved_tensors
    try:
        sb.fla_saved_tensors = lambda _block: contextlib.nullcontext()
        stand_ins = sb.language_layer_saved(block, cfg, 128, dtype=torch.bfloat16)
    finally:
        sb.fla_saved_tensors = swap
    assert stand_ins > fla + 128 * terms["delta rule"], (stand_ins, fla)


# ---- the forecast: each stage by its own layer kinds ----------------------------------------------------
HYBRID = {"model_type": "qwen3_5", "tie_word_embeddings": False,
          "text_config": {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 8,
                          "hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "vocab_size": 4096,
                          "layer_types": [LIN, LIN, LIN, FULL, FULL, FULL, FULL, FULL],
                          "rope_parameters": {"partial_rotary_factor": 0.25},
                          "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 32,
                          "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4},
          "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                            "out_hidden_size": 256, "patch_size": 16, "spatial_merge_size": 2,
                            "temporal_patch_size": 2, "num_position_embeddings": 64}}


def _forecast(tmp_path, config: dict, *components, extra=()):
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--hf-model", str(tmp_path), "--allow-random-init", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--seq-length", "512", "--gpu-memory-gb", "100000", *extra]
    for c in components:
        args += ["--component", f"{c}"]
    result = check_config(load_config(args))
    assert result.ok, result.problems
    return result.memory["modules"]["language"]


def _kind_bytes(d, **kw) -> dict[str, float]:
    return {k: sum(act.language_layer_terms(d, tp=1, sp=False, b=2, layer_type=k, **kw).values()) for k in (LIN, FULL)}


def test_each_stage_counts_its_own_layer_kinds(tmp_path):
    """pp 2 over [3 GDN + 1 full | 4 full]: stage 0 keeps 3 GDN + 1 full layers, stage 1 four full ones;
    1F1B keeps 2 micro-batches in flight on stage 0, 1 on stage 1."""
    d = TextDims.from_config(HYBRID)
    per = _kind_bytes(d)
    assert per[LIN] != per[FULL]
    kinds = HYBRID["text_config"]["layer_types"]
    for stage in (0, 1):
        expected = [per[k] for k in kinds[4 * stage:4 * stage + 4]]
        assert act.language_stage_layers(d, tp=1, sp=False, b=2, pp=2, stage=stage) == expected
    lang = _forecast(tmp_path, HYBRID, "language=pp=2,dp=1", "images=dp=1,rank_offset=2", extra=["--dtype", "bf16"])
    stage = int(lang["rank"].split()[2])
    flight = 2 - stage
    assert lang["terms"]["activations"] == int(flight * 2 * 512 * sum(per[k] for k in kinds[4 * stage:4 * stage + 4]))


def test_full_recompute_groups_and_blocks_follow_the_kinds(tmp_path):
    """Uniform groups of 2 on [G G G F]: the largest group rebuilt is G + F; block of 1: the stage's first layer."""
    d = TextDims.from_config(HYBRID)
    per = _kind_bytes(d)
    inp = act.language_layer_input(d, tp=1, sp=False, b=2)
    tokens = 2 * 512
    common = ["--dtype", "bf16", "--recompute-granularity", "full"]
    uni = _forecast(tmp_path, HYBRID, "language=pp=2,dp=1", "images=dp=1,rank_offset=2",
                    extra=[*common, "--recompute-method", "uniform", "--recompute-num-layers", "2"])
    stage = int(uni["rank"].split()[2])
    group = per[LIN] + per[FULL] if stage == 0 else 2 * per[FULL]
    assert uni["terms"]["recompute"] == int(group * tokens)
    assert uni["terms"]["activations"] == int((2 - stage) * 2 * inp * tokens)
    blk = _forecast(tmp_path, HYBRID, "language=dp=1", "images=dp=1,rank_offset=1",
                    extra=[*common, "--recompute-method", "block", "--recompute-num-layers", "1"])
    assert blk["terms"]["recompute"] == int(per[LIN] * tokens)  # layer 0 is a GDN layer
    kinds = HYBRID["text_config"]["layer_types"]
    assert blk["terms"]["activations"] == int((inp + sum(per[k] for k in kinds[1:])) * tokens)


def test_27b_pipeline_layout_is_forecast(q35_27b):
    """language tp 4 x pp 2 (sequence parallel) + images dp 1: every stage holds 24 GDN and 8 full-attention
    layers (the 3:1 pattern), so a stage's activations are the two kinds' per-rank bytes in that ratio."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    cfg = load_config(["--hf-model", q35_27b, "--allow-random-init", "--component", "language=tp=4,pp=2,dp=1",
                       "--component", "images=dp=1,rank_offset=8", "--dtype", "bf16", "--sequence-parallel",
                       "--micro-batch-size", "1", "--global-batch-size", "16", "--seq-length", "4096",
                       "--gpu-memory-gb", "141"])
    result = check_config(cfg, world_size=9)
    assert result.ok, result.problems
    lang = result.memory["modules"]["language"]
    d = TextDims.from_config(read_hf_config(q35_27b))
    per = {k: sum(act.language_layer_terms(d, tp=4, sp=True, b=2, layer_type=k).values()) for k in (LIN, FULL)}
    stage = int(lang["rank"].split()[2])
    assert lang["terms"]["activations"] == int((2 - stage) * 4096 * (24 * per[LIN] + 8 * per[FULL]))
    assert lang["peak_bytes"] == sum(lang["terms"].values()) and result.memory["modules"]["images"]["peak_bytes"] > 0
