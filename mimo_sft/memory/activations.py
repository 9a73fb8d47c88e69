"""Bytes autograd keeps for backward, per token of a decoder layer and per patch of a vision block.

Each formula lists the tensors the real layer saves (``mimo_sft.testing.saved_bytes`` counts them; the
figures in docs/memory.md and the tests compare both), with ``b`` the parameter dtype's bytes and
fp32 statistics at 4 bytes:

decoder layer (megatron local spec, our SDPA core, torch's RMSNorm), per token, tensor rank of ``tp``:
    norms          2 x (4h fp32 input + 4h fp32 normalised + 4 rstd)     [/tp with sequence parallelism]
    linear inputs  b h (QKV input) + b h (fc1 input)                      [/tp with sequence parallelism]
    qkv            b (heads + 2 kv) d (fused output, held by V's view) + b (heads + kv) d (rotated q, k) /tp
    rotary         4 b d (cos and sin for q and k)
    attention      4 heads (log-sum-exp) + b heads d (output)             /tp
    mlp            b 2 ffn (fc1 output) + 3 b ffn (SiLU output, product, gate view)   /tp
selective ``core_attn`` drops the log-sum-exp (flash attention keeps no score matrix, so this module
saves little); ``mlp`` keeps only its input (already the fc1 input above); full recompute keeps only
the layer's input, ``b h`` (/tp with sequence parallelism).

Qwen3 adds q/k norms (RMSNorm over the head dim, torch's): (heads + kv) (2 x 4 hd fp32 + 4 rstd) /tp.

vision block (transformers' Qwen2.5-VL, one SDPA call over all windows: ``model.vision_attention``), per patch:
    norms          2 x (4h fp32 input + 4 rstd + b h normalised + b h scaled)
    qkv            3 b h (the padded q, k, v copies SDPA keeps; window padding at page edges adds a few %)
    attention      4 heads (log-sum-exp) + 2 b h (output, its contiguous copy for proj)
    mlp            4 b ffn (gate and up outputs, SiLU output, product)
Qwen3-VL's block (LayerNorm, plain GELU MLP): norms 2 x (b h input + 8 mean/rstd + b h output),
mlp 2 b ffn (fc1 output, GELU output), qkv and attention as above (measured at width 1152: 38,032
bytes per patch in bf16, equal to the formula).
with ``--recompute-vision`` a block keeps only its input, ``b h``.

Pure arithmetic (no torch).
"""

from __future__ import annotations

from mimo_sft.memory.dims import TextDims, VisionDims

FP32 = 4
#: megatron recompute modules the forecast models (others are ignored: no effect assumed)
MODELLED_RECOMPUTE_MODULES = ("core_attn", "mlp")


def language_layer_terms(d: TextDims, *, tp: int, sp: bool, b: int, recompute_modules=()) -> dict[str, float]:
    """Bytes per token one decoder layer keeps on one tensor rank, by term."""
    seq = tp if sp else 1
    h, hd = d.hidden, d.head_dim
    heads, kv, ffn = d.heads // tp, d.kv_heads // tp, d.ffn // tp
    terms = {
        "norms": 2 * (2 * FP32 * h + FP32) / seq,
        "linear inputs": 2 * b * h / seq,
        "qkv": b * (heads + 2 * kv) * hd + b * (heads + kv) * hd,
        "rotary": 4 * b * hd,
        "attention": FP32 * heads + b * heads * hd,
        "mlp": 5 * b * ffn,
    }
    if d.qk_norm:  # Qwen3: torch's RMSNorm on each q and k head (fp32 input and normalised, fp32 rstd)
        terms["qk norm"] = (heads + kv) * (2 * FP32 * hd + FP32)
    if "core_attn" in recompute_modules:
        terms["attention"] -= FP32 * heads
    if "mlp" in recompute_modules:
        terms["mlp"] = 0.0
    return terms


def language_layer_input(d: TextDims, *, tp: int, sp: bool, b: int) -> float:
    """Bytes per token a fully recomputed layer (or group) keeps: its input."""
    return b * d.hidden / (tp if sp else 1)


def language_head_terms(d: TextDims, *, tp: int, sp: bool, b: int) -> dict[str, float]:
    """Per token on the last stage: the final norm, the output layer's input, and megatron's
    vocab-parallel cross entropy, which keeps the fp32 softmax of this rank's vocabulary slice, with the
    bf16 logits (forward) or their gradient (backward) beside it."""
    seq = tp if sp else 1
    vocab = d.padded_vocab(tp) // tp
    return {"final norm": (2 * FP32 * d.hidden + FP32 + b * d.hidden) / seq,
            "cross entropy": (FP32 + (b if b != FP32 else 0)) * vocab}


def vision_block_terms(v: VisionDims, *, b: int) -> dict[str, float]:
    """Bytes per patch one vision block keeps, by term (Qwen2.5-VL's RMSNorm + gated MLP, or Qwen3-VL's
    LayerNorm + plain MLP: ``v.layer_norm``, ``v.gated_mlp``)."""
    h = v.hidden
    norm = (b * h + 2 * FP32 + b * h) if v.layer_norm else (FP32 * h + FP32 + 2 * b * h)
    return {
        "norms": 2 * norm,
        "qkv": 3 * b * h,
        "attention": FP32 * v.heads + 2 * b * h,
        "mlp": (4 if v.gated_mlp else 2) * b * v.ffn,
    }


def vision_block_input(v: VisionDims, *, b: int) -> float:
    return float(b * v.hidden)


def merger_terms(v: VisionDims, *, b: int) -> float:
    """Bytes per patch the mergers keep: the patch merger's norm (as a vision norm) and the GELU's input
    and output (``merge^2 h`` wide per merged token, ``h`` per patch each); each DeepStack merger
    (``v.deepstack``) the same, its LayerNorm over the merged width reading the block output the next
    block keeps anyway (statistics per merged token)."""
    h = v.hidden
    norm = (b * h + 2 * FP32 + b * h) if v.layer_norm else (FP32 * h + FP32 + 2 * b * h)
    deepstack = b * h + 2 * FP32 / v.merge ** 2 + 2 * b * h
    return norm + 2 * b * h + v.deepstack * deepstack


def vision_input_terms(v: VisionDims, *, b: int, tower_trains: bool) -> float:
    """Bytes per patch of the tower's inputs: fp32 ``pixel_values``, their cast that the patch embedding
    keeps when it trains, and the fp32 rotary cos/sin tables every block reads."""
    head_dim = v.hidden // v.heads
    return FP32 * v.patch_values + (b * v.patch_values if tower_trains else 0) + 2 * FP32 * head_dim
