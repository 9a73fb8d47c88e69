"""Bytes autograd keeps for backward, per token of a decoder layer and per patch of a vision block.

Each formula lists the tensors the real layer saves (``mimo_sft.testing.saved_bytes`` counts them; the
figures in docs/memory.md and the tests compare both), with ``b`` the parameter dtype's bytes and
fp32 statistics at 4 bytes. The forecast targets a device (``DEVICES``, ``cuda`` by default: what
clusters run), because torch's RMSNorm keeps less on CUDA:

    RMSNorm over w   cuda: b w + 4          torch's fused kernel (``_fused_rms_norm``; its derivative in
                                            torch's derivatives.yaml keeps the input, the weight and fp32
                                            rstd): derived, torch's own autograd node recorded on the CPU
                                            (``saved_bytes.cuda_rms_norm_saved_tensors``), not measured on a GPU
                     cpu:  4w + 4w + 4      the composite torch runs elsewhere: fp32 copies of the input and
                                            of the normalised rows, rstd (measured)
Qwen3.5's zero-centred norms (``model.norm``) are one ``F.rms_norm`` over an fp32 copy of the input: the
figures above with ``b = 4`` (cuda ``4w + 4``: the fused kernel keeps that copy and rstd; cpu ``8w + 4``).
The vision towers' norms (transformers' composites) keep the cpu figure on every device.

decoder layer (megatron local spec, our SDPA core, torch's RMSNorm), per token, tensor rank of ``tp``:
    norms          2 x RMSNorm over h                                     [/tp with sequence parallelism]
    linear inputs  b h (QKV input) + b h (fc1 input)                      [/tp with sequence parallelism]
    qkv            b (heads + 2 kv) d (fused output, held by V's view) + b (heads + kv) d (rotated q, k) /tp
    rotary         4 b d (cos and sin for q and k)
    attention      4 heads (log-sum-exp) + b heads d (output)             /tp
    mlp            fused SwiGLU (megatron's ``bias_activation_fusion``, ``FUSED_SWIGLU``): 2 b ffn (fc1
                   output, all its autograd Function keeps) + b ffn (its output, fc2's input) = 3 b ffn;
                   unfused: 2 b ffn + 3 b ffn (SiLU output, ``up + 0`` copy, product)   /tp
selective ``core_attn`` drops the log-sum-exp (flash attention keeps no score matrix, so this module
saves little); ``mlp`` keeps only its input (already the fc1 input above); full recompute keeps only
the layer's input, ``b h`` (/tp with sequence parallelism).

Qwen3 adds q/k norms (RMSNorm over the head dim, torch's), /tp: cpu (heads + kv) (2 x 4 hd + 4); cuda the
fused kernel keeps its inputs: k is a view of the fused QKV output (counted above), q a fresh copy
``b heads hd`` where several q heads share a KV group (megatron reshapes q out of the fused output),
plus 4 (heads + kv) rstd.

Qwen3.5's hybrid decoder (``d.layer_types``; its zero-centred RMSNorms keep what torch's keep, plus a
fp32 ``1 + w`` per layer, not per token) counts each layer by its kind. A full-attention layer: the
terms above, its fused output ``b qkv_width`` (q rows doubled by the output gate), rotary over the
rotated channels only, ``4 b rot`` (partial rotary), and
    output gate    2 b heads d /tp   (the gate's contiguous copy torch.compile's fused gate keeps, and
                                      the gated product: the output projection's input)
A Gated DeltaNet layer (megatron's ``GatedDeltaNet``; its three ``jit_fuser`` helpers compiled, the
kernels fla's: ``causal_conv1d``, ``l2norm``, ``chunk_gated_delta_rule``), per token, with
qk = key heads x key dim, v = value heads x value dim, hv = value heads, kh = key heads, all /tp:
    norms, linear inputs   as above (in_proj's and fc1's inputs)
    in_proj output   b (2 qk + 2 v + 2 hv)        kept whole: fla's conv keeps its input, a view of it
    qk l2norm        b 2 qk + 4 x 2 kh            fla's l2norm keeps its output and fp32 1/||x||
    delta rule       2 b hv dk + b v + 4 hv + b hv + 64 b hv
                     fla keeps q and k (repeated to the value heads), v, fp32 chunk-cumulative g,
                     beta and the inverted 64-wide intra-chunk matrix A; everything else it recomputes
    decay gate       b hv                          the compiled g/beta helper keeps alpha
    gated norm       2 b v + 4 hv                  the compiled norm keeps the core output, z and rstd
    out_proj input   b v
    mlp              as above
(measured at Qwen3.5-27B's width in bf16, tp 1: 328,584 bytes per GDN layer token and 344,792 per
full-attention token with the fused SwiGLU, 398,216 and 414,424 without, equal to the measurement less
the per-layer ``1 + w`` tables; the compiled
helpers' tensors are what torch.compile's partitioner picks, measured with inductor on the CPU, not yet
checked on a GPU.) Selective
``core_attn`` recomputes only attention's core: a GDN layer keeps all of the above; ``mlp`` drops
the MLP in both kinds.

vision block (transformers' Qwen2.5-VL, one SDPA call over all windows: ``model.vision_attention``), per patch
(the same on every device: its norms are transformers' own composite, the kernels flash-style):
    norms          2 x (4h fp32 input + 4 rstd + b h normalised + b h scaled)
    qkv            3 b h (the padded q, k, v copies SDPA keeps)
    attention      4 heads (log-sum-exp) + 2 b h (output, its contiguous copy for proj)
    mlp            4 b ffn (gate and up outputs, SiLU output, product)
Attention is per image (full-attention blocks) or per window: each segment is one row of a padded batch
(``model.segments``), so its q, k, v, output and log-sum-exp are kept per padded slot, ``(4 b h + 4 heads)``
each: linear in the patches of every image of a sample, no term in an image's patches squared. The
formulas count real patches; the padding (each image to a multiple of 8 patches, windows at image edges
to 64, a short image padded to its group's longest) adds a few % to a block (measured: docs/memory.md);
a forecast from the data (``memory.from_data``) bounds it: ``vision_padding_bytes``, ``language_slot_bytes``.
Qwen3-VL's block (LayerNorm, plain GELU MLP): norms 2 x (b h input + 8 mean/rstd + b h output),
mlp 2 b ffn (fc1 output, GELU output), qkv and attention as above (measured at width 1152: 38,032
bytes per patch in bf16, equal to the formula).
with ``--recompute-vision`` a block keeps only its input, ``b h``.

Pure arithmetic (no torch).
"""

from __future__ import annotations

from mimo_sft.memory.dims import FULL_ATTENTION, LINEAR_ATTENTION, TextDims, VisionDims

FP32 = 4
#: the forecast's target devices; their kernels keep different tensors for backward (``norm_bytes``)
CUDA, CPU = "cuda", "cpu"
DEVICES = (CUDA, CPU)
#: megatron's fused SwiGLU in the decoder MLP (``bias_activation_fusion``): what the model's
#: ``language_transformer_config`` sets (tests/test_memory_swiglu.py holds the two equal)
FUSED_SWIGLU = True
#: fla's chunk length: the gated delta rule keeps one ``[64]`` row of the inverted intra-chunk matrix per head and token
GDN_CHUNK = 64
#: megatron recompute modules the forecast models (others are ignored: no effect assumed)
MODELLED_RECOMPUTE_MODULES = ("core_attn", "mlp")


def norm_bytes(width: int, *, b: int, fused: bool) -> float:
    """Bytes per row an RMSNorm over ``width`` keeps: torch's fused CUDA kernel its input and fp32 rstd
    (``b w + 4``), the composite (torch on the CPU, our own norms everywhere) fp32 copies of the input and
    of the normalised rows and rstd (``8 w + 4``; in fp32 the first copy is the input itself)."""
    return b * width + FP32 if fused else 2 * FP32 * width + FP32


def fused_norms(d: TextDims, device: str) -> bool:
    """Whether the decoder's norms run torch's fused RMSNorm kernel: torch's ``nn.RMSNorm`` on CUDA."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return device == CUDA and d.torch_norm


def decoder_norm_bytes(d: TextDims, width: int, *, b: int, device: str) -> float:
    """Bytes per row one decoder RMSNorm over ``width`` keeps on ``device``: torch's ``nn.RMSNorm``
    (:func:`norm_bytes` of the model dtype), or Qwen3.5's zero-centred norm, one ``F.rms_norm`` over an
    fp32 copy of its input (``model.norm``): on CUDA the fused kernel keeps that copy and rstd
    (``4 w + 4``), elsewhere the composite keeps the cpu figure (``8 w + 4``)."""
    fused_norms(d, device)  # (refuses an unknown device)
    return norm_bytes(width, b=b if d.torch_norm else FP32, fused=device == CUDA)


def rotary_dim(d: TextDims) -> int:
    """Rotary channels per attention head: ``d.rotary_dim`` where the dims carry a partial rotary
    (Qwen3.5's 0.25), else every channel."""
    return getattr(d, "rotary_dim", 0) or d.head_dim


def _attention_terms(d: TextDims, *, tp: int, b: int, recompute_modules, device: str) -> dict[str, float]:
    hd, heads, kv = d.head_dim, d.heads // tp, d.kv_heads // tp
    terms = {
        "qkv": b * d.qkv_width // tp + b * (heads + kv) * hd,
        "rotary": 4 * b * rotary_dim(d),
        "attention": FP32 * heads * ("core_attn" not in recompute_modules) + b * heads * hd,
    }
    if d.qk_norm and fused_norms(d, device):  # the fused kernel keeps its inputs: k a view of the QKV output,
        terms["qk norm"] = FP32 * (heads + kv) + (b * heads * hd if heads > kv else 0)  # q a copy under GQA
    elif d.qk_norm:  # Qwen3 on the CPU, Qwen3.5 (its own norm, over an fp32 copy) everywhere
        terms["qk norm"] = (heads + kv) * decoder_norm_bytes(d, hd, b=b, device=device)
    if d.attn_gate:  # Qwen3.5: sigmoid(gate) * output, fused by torch.compile
        terms["output gate"] = 2 * b * heads * hd
    return terms


def _gdn_terms(d: TextDims, *, tp: int, b: int) -> dict[str, float]:
    g = d.gdn
    qk, v, hv, kh = g.qk // tp, g.v // tp, g.value_heads // tp, g.key_heads // tp
    return {
        "in_proj output": b * g.in_proj_rows(tp),
        "qk l2norm": 2 * b * qk + FP32 * 2 * kh,
        "delta rule": 2 * b * hv * g.key_dim + b * v + FP32 * hv + b * hv + b * hv * GDN_CHUNK,
        "decay gate": b * hv,
        "gated norm": 2 * b * v + FP32 * hv,
        "out_proj input": b * v,
    }


def _moe_terms(d: TextDims, *, seq: int, tp: int, etp: int, b: int, swiglu_fused: bool = True) -> dict[str, float]:
    """A sparse layer's MLP (megatron ``MoELayer``, alltoall dispatcher, ``SequentialMLP``), per token. The
    router keeps, on the rank's own tokens, an int64 index over the experts (``8 E``) and per routed slot the
    int64 top-k and permutation indices and two fp32 weights (``24 k``); the experts keep, for each of the ``k``
    slots a token is routed to, its ``h``-wide input row and the fused SwiGLU's fc1 output and product
    (``3 x ffn/etp``), with routing balanced over the experts (an expert that draws more tokens keeps more);
    the tokens of the ``etp`` ranks that share an expert are gathered, so each keeps ``etp`` times the rows of its
    own tokens. A shared expert (Qwen3.5-MoE) keeps a dense MLP's ``3 b ffn/tp``, its output ``b h`` for the
    gate's product and the gate ``b``. Every tensor named here was listed from a real-width layer with a
    random router (``testing.saved_bytes``, docs/memory.md)."""
    # unfused (``bias_activation_fusion`` off; training always fuses): the experts' weighted SwiGLU keeps 6 x ffn
    # per slot (measured), the shared expert's plain one the dense MLP's 5
    routed, shared = (3, 3) if swiglu_fused else (6, 5)
    terms = {"router": (8 * d.experts + 24 * d.topk) / seq,
             "experts": d.topk * b * (etp * d.hidden + routed * d.expert_ffn) / seq}
    if d.shared_ffn:
        terms["shared expert"] = shared * b * (d.shared_ffn // tp) + b * (d.hidden + 1) / seq
    return terms


def language_layer_terms(d: TextDims, *, tp: int, sp: bool, b: int, recompute_modules=(),
                         layer_type: str = FULL_ATTENTION, device: str = CUDA,
                         swiglu_fused: bool = FUSED_SWIGLU, index: int | None = None,
                         etp: int | None = None) -> dict[str, float]:
    """Bytes per token one decoder layer of ``layer_type`` keeps on one tensor rank of ``device``, by term
    (global layer ``index``: a mixture-of-experts decoder's sparse layers keep their router and experts'
    tensors in place of the dense MLP's; ``etp`` defaults to ``tp``)."""
    seq = tp if sp else 1
    h = d.hidden
    terms = {"norms": 2 * decoder_norm_bytes(d, h, b=b, device=device) / seq, "linear inputs": 2 * b * h / seq}
    if layer_type == LINEAR_ATTENTION:
        terms.update(_gdn_terms(d, tp=tp, b=b))
    else:
        terms.update(_attention_terms(d, tp=tp, b=b, recompute_modules=recompute_modules, device=device))
    if d.is_sparse(index):
        terms.update(_moe_terms(d, seq=seq, tp=tp, etp=tp if etp is None else etp, b=b, swiglu_fused=swiglu_fused))
    else:
        terms["mlp"] = 0.0 if "mlp" in recompute_modules else (3 if swiglu_fused else 5) * b * (d.ffn // tp)
    return terms


def language_stage_layers(d: TextDims, *, tp: int, sp: bool, b: int, pp: int, stage: int,
                          recompute_modules=(), device: str = CUDA, etp: int | None = None) -> list[float]:
    """Bytes per token of each layer of pipeline stage ``stage``, in order, each by its own kind."""
    return [sum(language_layer_terms(d, tp=tp, sp=sp, b=b, recompute_modules=recompute_modules,
                                     layer_type=d.layer_type(i), device=device, index=i, etp=etp).values())
            for i in d.stage_layers(pp, stage)]


def lora_dropout_bytes(d: TextDims, targets, *, tp: int, b: int, layer_type: str = FULL_ATTENTION) -> float:
    """Per token, with LoRA dropout: each adapted linear's input is dropped out into a copy, with its
    bool mask. The mixer targets adapt attention's ``linear_qkv`` / ``linear_proj`` or a GDN layer's
    ``in_proj`` / ``out_proj`` (``model.lora.LANGUAGE_LAYERS``)."""
    out_width = d.gdn.v // tp if layer_type == LINEAR_ATTENTION else d.heads * d.head_dim // tp
    widths = {"linear_qkv": d.hidden, "linear_proj": out_width, "linear_fc1": d.hidden, "linear_fc2": d.ffn // tp}
    return sum((b + 1) * widths[t] for t in targets)


def language_layer_input(d: TextDims, *, tp: int, sp: bool, b: int) -> float:
    """Bytes per token a fully recomputed layer (or group) keeps: its input."""
    return b * d.hidden / (tp if sp else 1)


def language_head_terms(d: TextDims, *, tp: int, sp: bool, b: int, device: str = CUDA) -> dict[str, float]:
    """Per token on the last stage: the final norm, the output layer's input, and megatron's
    vocab-parallel cross entropy, which keeps the fp32 softmax of this rank's vocabulary slice, with the
    bf16 logits (forward) or their gradient (backward) beside it."""
    seq = tp if sp else 1
    vocab = d.padded_vocab(tp) // tp
    return {"final norm": (decoder_norm_bytes(d, d.hidden, b=b, device=device) + b * d.hidden) / seq,
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


#: the padded layout's indexes (``model.segments.PaddedRows``): one int64 per slot (the packed row each slot
#: reads) and one per real position (the copy back), kept where any segment is padded
SEGMENT_INDEX = 8


def language_slot_bytes(d: TextDims, *, tp: int, b: int, layer_type: str = FULL_ATTENTION,
                        recompute_modules=()) -> float:
    """Bytes one decoder layer keeps per padded attention slot of a packed micro-batch (``model.segments``:
    each sample a row of a padded batch): the padded copy of q, k and v that SDPA keeps, its padded output
    and log-sum-exp. None for a Gated DeltaNet layer (fla's kernels take the packed sequence as it is) or
    with ``core_attn`` recomputed (the checkpoint keeps only the real q, k, v). (The layout's indexes, 16 bytes
    a token, are within the padded-row figure per token, which a packed layer keeps 504 bytes under at
    Qwen2.5-VL-3B's width: docs/memory.md.)"""
    if layer_type == LINEAR_ATTENTION or "core_attn" in recompute_modules:
        return 0.0
    heads, kv = d.heads // tp, d.kv_heads // tp
    return 2 * b * (heads + kv) * d.head_dim + FP32 * heads


def vision_full_rows_saving(v: VisionDims, *, b: int) -> float:
    """At most the bytes per patch a block keeps *less* than ``vision_block_terms`` when every segment fills its
    padded row (``model.segments``: a plain view, no index op): the output projection's input is then a view of
    SDPA's own output (one ``b h`` fewer), and no index back is kept (up to ``SEGMENT_INDEX``). The forecast keeps
    the terms: an upper bound for any image size."""
    return float(b * v.hidden + SEGMENT_INDEX)


def vision_padding_bytes(v: VisionDims, *, b: int, patches: int, slots: int) -> float:
    """What one vision block keeps for its attention's padding, beyond ``vision_block_terms`` x ``patches``, when
    its segments take ``slots`` padded slots: per padded slot its stacked q, k, v and output copies and
    log-sum-exp (``4 b h + 4 heads``); per slot the key mask (SDPA keeps it in the activations' dtype, ``b``) and
    the layout's gather index, and per patch the index back (``model.segments``)."""
    return ((4 * b * v.hidden + FP32 * v.heads) * max(0, slots - patches) + (SEGMENT_INDEX + b) * slots
            + SEGMENT_INDEX * patches)
