"""Model FLOPs of a Qwen-VL training step, GPU peak throughput, and MFU.

Pure arithmetic on a transformers Qwen-VL config (no torch.distributed, no megatron); the vision
tower's formula is its family's (``FamilySpec.vision_flops``, ``model.vision_flops``),
so the trainer can log *model* TFLOP/s per GPU and MFU the way torchtitan and Megatron-Bridge do.

Conventions (all counts are FLOPs, i.e. one multiply-add = 2):

* Only matrix multiplies are counted (``2 * m * n * k``): linear layers, convolutions (the vision patch
  embedding, the GDN conv), the delta rule's triangular solves (``n*(n-1)`` per right-hand column of a
  unit-triangular n x n system), attention scores ``Q K^T`` and ``softmax(.) V``, the LM head. Norms,
  activations, rotary embeddings, softmax, residual adds, biases and the embedding lookup are not counted (they are
  a fraction of a percent of the total and do not run on the tensor cores anyway).
* Causal language attention is counted as the **full S x S square** (what Megatron's and torchtitan's
  formulas do, and what eager / unfused attention computes). Causal flash kernels skip roughly half
  of it, so MFU computed this way slightly flatters long sequences; it is the common convention, so
  numbers stay comparable with other frameworks.
* Qwen3.5's Gated DeltaNet layers: their projections and depthwise causal conv count per token (the
  conv as ``2 * channels * kernel``, over the S positions it keeps); the chunked gated delta rule counts
  the matmuls and triangular solves transformers' torch path runs on each sequence padded to whole
  64-token chunks (``sequence_mixing_flops``), linear in tokens. Only the full-attention layers have the
  S x S term.
* Training = forward + backward = **3 x forward** (backward computes gradients for both the inputs and
  the weights of every matmul). ``training_flops`` takes per-part factors for runs with frozen parts.
* Language: what was *computed* counts. A sample padded to length S costs S (padded positions go
  through every layer); with packing pass the real per-sequence lengths. Attention is per sequence
  (``sum S_i^2``), everything else per token (``sum S_i``). The LM head runs on every position.
* Vision: per image/video ``(t, h, w)`` grid in patches (``image_grid_thw``), by the family's formula
  (``model.vision_flops``: Qwen2.5-VL's windowed tower, Qwen3-VL's full-attention tower with its
  DeepStack mergers, Qwen3.5's the same tower without them), exact for transformers' modules under the
  conventions above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

#: backward ~= 2 x forward (activation gradients + weight gradients), so a training step is 3 x forward
TRAIN_FACTOR = 3.0


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step (forward only or forward+backward, depending on who built it)."""

    language: float
    vision: float
    total: float = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total", float(self.language) + float(self.vision))

    def scaled(self, language: float, vision: float | None = None) -> "StepFlops":
        """A copy with the language part times ``language`` and the vision part times ``vision``."""
        return StepFlops(self.language * language, self.vision * (language if vision is None else vision))


# --------------------------------------------------------------------------------------- language

#: tokens per chunk of the chunked gated delta rule (transformers' torch path and fla's kernels)
GDN_CHUNK = 64
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


def _text_dims(text_config):
    t = text_config
    heads = t.num_attention_heads
    kv = getattr(t, "num_key_value_heads", None) or heads
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // heads
    ffn = getattr(t, "intermediate_size", None) or getattr(t, "moe_intermediate_size", 0)  # Qwen3.5-MoE: no dense MLP
    return t.hidden_size, t.num_hidden_layers, heads, kv, head_dim, ffn, t.vocab_size


def _is_hybrid(t) -> bool:
    """Qwen3.5's decoder: its text config carries the Gated DeltaNet sizes (``linear_*``)."""
    return getattr(t, "linear_num_value_heads", None) is not None


def _layer_types(t) -> list[str]:
    """Each layer's token mixer; a plain decoder is all full attention (its ``layer_types``, where it has
    one, name sliding windows, which change no matmul count here)."""
    layers = t.num_hidden_layers
    if not _is_hybrid(t):
        return [FULL_ATTENTION] * layers
    types = list(t.layer_types)
    if len(types) != layers or set(types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise ValueError(f"text_config.layer_types {types} must name {layers} layers, each "
                         f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")
    return types


def _gdn_dims(t) -> tuple[int, int, int, int, int]:
    """``(key heads, value heads, key head dim, value head dim, conv kernel)`` of a Gated DeltaNet layer."""
    return (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim,
            t.linear_conv_kernel_dim)


def _sparse_layers(t) -> frozenset:
    """A mixture-of-experts decoder's sparse layers (``config.families.sparse_layer_indexes``); none for a dense one."""
    from mimo_sft.config.families import sparse_layer_indexes

    experts = getattr(t, "num_experts", None) or getattr(t, "num_local_experts", None)
    if not experts or not getattr(t, "moe_intermediate_size", None):
        return frozenset()
    return sparse_layer_indexes({"num_hidden_layers": t.num_hidden_layers, "num_experts": experts,
                                 "decoder_sparse_step": getattr(t, "decoder_sparse_step", 1),
                                 "mlp_only_layers": getattr(t, "mlp_only_layers", None) or []})


def _layer_matmul_params(t, layer_type: str, sparse: bool = False) -> int:
    """Weights of one decoder layer that take part in a matmul per token (biases aside). A sparse layer counts
    its router and the ``num_experts_per_tok`` experts each token runs through (active, not total, weights)."""
    h, _, heads, kv, hd, ffn, _ = _text_dims(t)
    mlp = 3 * h * ffn
    if sparse:
        experts = getattr(t, "num_experts", None) or t.num_local_experts
        shared = getattr(t, "shared_expert_intermediate_size", 0) or 0  # Qwen3.5-MoE: every token, and its gate
        mlp = h * experts + t.num_experts_per_tok * 3 * h * t.moe_intermediate_size + (3 * h * shared + h if shared else 0)
    if layer_type == LINEAR_ATTENTION:
        nk, nv, dk, dv, kernel = _gdn_dims(t)
        qkv = 2 * nk * dk + nv * dv
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; the depthwise conv over the qkv channels; out_proj
        return h * (qkv + nv * dv + 2 * nv) + qkv * kernel + nv * dv * h + mlp
    q_rows = heads * hd * (2 if _is_hybrid(t) else 1)  # Qwen3.5's q_proj also emits a per-head output gate
    return h * (q_rows + 2 * kv * hd) + heads * hd * h + mlp


def gdn_mixing_flops_per_head_token(text_config, chunk: int = GDN_CHUNK) -> int:
    """Matmul FLOPs of the chunked gated delta rule per value head and (chunk-padded) token.

    transformers' ``torch_chunk_gated_delta_rule`` (q and k repeated to the value heads) does per head and
    chunk of C tokens: ``k_beta @ k^T`` and ``q @ k^T`` (``2*2*C*C*dk``); two unit-lower-triangular solves of
    the C x C system, right sides ``v_beta`` [C, dv] and the decayed ``k_beta`` [C, dk] (forward
    substitution: ``C*(C-1)*(dv+dk)``); and in the scan over chunks ``k_cumdecay @ S`` and ``q @ S`` against
    the [dk, dv] state (``2*2*C*dk*dv``), the intra-chunk ``attn @ v_new`` (``2*C*C*dv``) and the state update
    ``k^T @ v_new`` (``2*C*dk*dv``). Per token: ``4*C*dk + 2*C*dv + (C-1)*(dk+dv) + 6*dk*dv``.
    """
    _, _, dk, dv, _ = _gdn_dims(text_config)
    c = chunk
    return 4 * c * dk + 2 * c * dv + (c - 1) * (dk + dv) + 6 * dk * dv


def sequence_mixing_flops(text_config, seq_lengths: Iterable[int]) -> float:
    """The FLOPs that are not a weight times a token: full attention's ``Q K^T`` and ``softmax(.) V`` on the
    full-attention layers (``2*2*S^2*heads*hd`` per sequence, the full square) and, on Gated DeltaNet layers,
    the chunked delta rule (``heads_v * ceil(S/64)*64 * gdn_mixing_flops_per_head_token``: each sequence
    is padded to whole chunks, as the chunked kernels compute it)."""
    _, _, heads, _, hd, _, _ = _text_dims(text_config)
    lengths = _lengths(seq_lengths)
    types = _layer_types(text_config)
    full, linear = types.count(FULL_ATTENTION), types.count(LINEAR_ATTENTION)
    out = full * 2 * 2 * heads * hd * sum(s * s for s in lengths)
    if linear:
        nv = _gdn_dims(text_config)[1]
        padded = sum(-(-s // GDN_CHUNK) * GDN_CHUNK for s in lengths)
        out += linear * nv * padded * gdn_mixing_flops_per_head_token(text_config)
    return float(out)


def _lengths(seq_lengths: Iterable[int]) -> list[int]:
    lengths = [int(s) for s in seq_lengths]
    if any(s < 0 for s in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
    return lengths


def language_forward_flops(text_config, seq_lengths: Iterable[int], *, vocab_size: int | None = None) -> float:
    """Forward matmul FLOPs of the decoder over sequences of the given (computed) lengths.

    ``text_config``: a Qwen-VL ``text_config`` (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, intermediate_size, vocab_size, optionally head_dim; Qwen3.5's also the
    ``linear_*`` Gated DeltaNet sizes and ``layer_types``). ``vocab_size`` overrides the LM-head width
    (e.g. megatron's padded vocab). ``2 * tokens * language_matmul_params`` (every weight once per
    token: per full-attention layer Q (Qwen3.5: Q and its gate, ``2*heads*hd`` rows), K, V, O; per
    Gated DeltaNet layer in_proj_qkv/z/b/a ``h*(2*nk*dk + 2*nv*dv + 2*nv)``, the depthwise conv
    ``(2*nk*dk + nv*dv)*kernel`` and out_proj ``nv*dv*h``; the gated MLP ``3*h*ffn``; the LM head
    ``h*vocab``) plus :func:`sequence_mixing_flops` (attention's square, the delta rule's chunks). A
    mixture-of-experts layer's MLP counts the router ``h*experts`` and the ``k`` experts a token is routed
    to, ``k*3*h*moe_ffn``: MFU is over the active parameters.
    """
    tokens = sum(_lengths(seq_lengths))
    return float(2 * tokens * language_matmul_params(text_config, vocab_size=vocab_size)
                 + sequence_mixing_flops(text_config, seq_lengths))


def language_matmul_params(text_config, *, vocab_size: int | None = None) -> int:
    """Weights that take part in a matmul per token: all decoder linears (and Qwen3.5's depthwise conv
    over the Gated DeltaNet qkv channels, ``2 * weights`` FLOPs per token like a linear) plus the LM head
    (counted even when tied to the embedding, because the head matmul runs either way); the embedding
    lookup and norms are excluded."""
    h, _, _, _, _, _, vocab = _text_dims(text_config)
    vocab = vocab if vocab_size is None else vocab_size
    sparse = _sparse_layers(text_config)
    return sum(_layer_matmul_params(text_config, kind, i in sparse)
               for i, kind in enumerate(_layer_types(text_config))) + h * vocab


def dense_flops_per_token(config, *, vocab_size: int | None = None) -> float:
    """The classic ``6 * N`` training FLOPs per language token (N = ``language_matmul_params``).

    It leaves out :func:`sequence_mixing_flops` (attention's ``S^2`` term, the delta rule's chunk work)
    and the vision tower, so it is below ``training_flops`` per token; the gap grows with sequence
    length and image count. For comparison only.
    """
    text = getattr(config, "text_config", config)
    return TRAIN_FACTOR * 2.0 * language_matmul_params(text, vocab_size=vocab_size)


# ----------------------------------------------------------------------------------------- vision

def _grids(image_grids) -> list[tuple[int, int, int]]:
    if image_grids is None:
        return []
    if hasattr(image_grids, "tolist"):  # a torch tensor / numpy array [n, 3]
        image_grids = image_grids.tolist()
    out = []
    for g in image_grids:
        t, h, w = (int(x) for x in g)
        if min(t, h, w) < 0:
            raise ValueError(f"image grid {g} has a negative size")
        out.append((t, h, w))
    return out


def vision_forward_flops(vision_config, image_grids, *, family: str | None = None) -> float:
    """Forward matmul FLOPs of the vision tower (mergers included) for the given ``(t, h, w)`` grids.

    The formula is the family's (``FamilySpec.vision_flops``: ``model.vision_flops``), ``family`` a
    ``--model-family`` name (default: the default family, Qwen2.5-VL).
    """
    import importlib

    from mimo_sft.config import families

    spec = next((f for f in families.families() if f.name == family), None) if family else families.default_family()
    assert spec is not None, f"unknown family {family!r}"
    module, _, fn = spec.vision_flops.partition(":")
    return float(getattr(importlib.import_module(module), fn)(vision_config, _grids(image_grids)))


def vision_attention_pairs(vision_config, image_grids) -> tuple[int, int]:
    """Qwen2.5-VL's full-attention and windowed attention pairs (``model.vision_flops``)."""
    from mimo_sft.model.vision_flops import windowed_attention_pairs

    return windowed_attention_pairs(vision_config, _grids(image_grids))


# ------------------------------------------------------------------------------------------ steps

def forward_flops(config, seq_lengths: Iterable[int], image_grids=None, *,
                  vocab_size: int | None = None) -> StepFlops:
    """Forward FLOPs of one step: ``seq_lengths`` are the computed language sequence lengths (padded
    length for padded samples), ``image_grids`` the ``(t, h, w)`` patch grids of every image the
    vision tower encoded in the step."""
    from mimo_sft.config.families import family_for_model_type

    lang = language_forward_flops(config.text_config, seq_lengths, vocab_size=vocab_size)
    spec = family_for_model_type(getattr(config, "model_type", None))
    vis = vision_forward_flops(config.vision_config, image_grids, family=spec.name if spec else None)
    return StepFlops(lang, vis)


def training_flops(config, seq_lengths: Iterable[int], image_grids=None, *, vocab_size: int | None = None,
                   language_factor: float = TRAIN_FACTOR, vision_factor: float = TRAIN_FACTOR) -> StepFlops:
    """Forward + backward FLOPs of one training step (3 x forward by default).

    The factors are for frozen parts: a frozen vision tower whose inputs need no gradient costs
    ``vision_factor=1``; a frozen language model still back-propagates to its inputs when the vision
    side trains (``language_factor=2``). The usual MFU convention keeps 3 for everything.
    """
    return forward_flops(config, seq_lengths, image_grids, vocab_size=vocab_size).scaled(language_factor, vision_factor)


# ----------------------------------------------------------------------------------- peak and MFU

#: Dense (no structured sparsity) BF16 tensor-core peak TFLOP/s per GPU, from the vendors' spec
#: sheets. NVIDIA sheets print the sparse figure with a "with sparsity" footnote; the dense value
#: is half of it (the sheet figure is quoted in each comment).
PEAK_TFLOPS: dict[str, float] = {
    "GB200": 2500.0,      # GB200 NVL72 sheet: 360 PFLOPS FP16/BF16 sparse / 72 GPUs = 5 PF sparse per GPU
    "B200": 2250.0,       # HGX B200 sheet: 4.5 PFLOPS FP16/BF16 per GPU, with sparsity
    "GH200": 989.0,       # GH200 sheet: 1,979 TFLOPS FP16/BF16, with sparsity
    "H200 NVL": 835.0,    # H200 NVL sheet: 1,671 TFLOPS BF16, with sparsity
    "H200": 989.0,        # H200 SXM sheet: 1,979 TFLOPS BF16, with sparsity
    "H100 NVL": 835.0,    # H100 NVL sheet: 1,671 TFLOPS BF16, with sparsity
    "H100 PCIe": 756.0,   # H100 PCIe sheet: 1,513 TFLOPS BF16, with sparsity
    "H100 SXM": 989.0,    # H100 SXM sheet: 1,979 TFLOPS BF16, with sparsity
    "H800 PCIe": 756.0,   # H800 PCIe sheet: 1,513 TFLOPS BF16, with sparsity
    "H800": 989.0,        # H800 SXM sheet: 1,979 TFLOPS BF16, with sparsity
    "H20": 148.0,         # H20 sheet: 148 TFLOPS BF16 dense (296 with sparsity)
    "A100": 312.0,        # A100 sheet (SXM and PCIe): 312 TFLOPS BF16 (624 with sparsity)
    "A800": 312.0,        # A800 sheet (SXM and PCIe): 312 TFLOPS BF16 (624 with sparsity)
    "L40S": 362.05,       # L40S sheet: 362.05 TFLOPS BF16 (733 with sparsity)
    "L40": 181.05,        # L40 sheet: 181.05 TFLOPS BF16 (362.1 with sparsity)
    "L4": 121.0,          # L4 sheet: 242 TFLOPS BF16, with sparsity
    "A10": 125.0,         # A10 sheet: 125 TFLOPS BF16 (250 with sparsity)
    "RTX 4090": 165.2,    # Ada GPU architecture whitepaper: 165.2 BF16 TFLOPS with FP32 accumulate (330.3 sparse)
    "RTX 3090": 71.0,     # Ampere GA102 whitepaper: 71 BF16 TFLOPS with FP32 accumulate (142 sparse)
    "MI325X": 1307.4,     # AMD Instinct MI325X sheet: 1307.4 TFLOPS peak BF16 (2614.9 with sparsity)
    "MI300X": 1307.4,     # AMD Instinct MI300X sheet: 1307.4 TFLOPS peak BF16 (2614.9 with sparsity)
    "MI250X": 383.0,      # AMD Instinct MI250X sheet: 383 TFLOPS peak BF16
}

# (pattern on the upper-cased name with '-' and '_' as spaces, PEAK_TFLOPS key), first match wins;
# the order puts specific names (NVL / PCIe variants, GB200 before B200, L40S before L40) first.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bGB200\b", "GB200"),
    (r"\bB200\b", "B200"),
    (r"\bGH200\b", "GH200"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200"),
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b.*\bPCIE\b", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"\bH800\b.*\bPCIE\b", "H800 PCIe"),
    (r"\bH800\b", "H800"),
    (r"\bH20\b", "H20"),
    (r"\bA100\b", "A100"),
    (r"\bA800\b", "A800"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10\b", "A10"),  # not A10G, whose peak NVIDIA does not publish
    (r"\bRTX 4090\b(?! ?D\b)", "RTX 4090"),  # not the cut-down 4090 D
    (r"\bRTX 3090\b(?! ?TI\b)", "RTX 3090"),  # not the 3090 Ti
    (r"\bMI325X\b", "MI325X"),
    (r"\bMI300X\b", "MI300X"),
    (r"\bMI250X\b", "MI250X"),
)


def peak_tflops_for(device_name: str | None) -> float | None:
    """Dense BF16 peak TFLOP/s for a device name as ``torch.cuda.get_device_name()`` reports it
    (e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"), or a ``PEAK_TFLOPS`` key;
    None when the GPU is unknown."""
    if not device_name:
        return None
    if device_name in PEAK_TFLOPS:
        return PEAK_TFLOPS[device_name]
    name = " ".join(re.sub(r"[-_]", " ", device_name).upper().split())
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name):
            return PEAK_TFLOPS[key]
    return None


def achieved_tflops_per_gpu(step_flops: float, step_time_s: float, num_gpus: int) -> float | None:
    """Model TFLOP/s per GPU: the step's FLOPs over its wall time and all GPUs of the job."""
    if step_time_s <= 0 or num_gpus <= 0:
        return None
    return step_flops / step_time_s / num_gpus / 1e12


def mfu(achieved_tflops_per_gpu: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0.42 = 42 %); None when either number is unknown."""
    if achieved_tflops_per_gpu is None or peak is None or peak <= 0:
        return None
    return achieved_tflops_per_gpu / peak


__all__ = ["GDN_CHUNK", "PEAK_TFLOPS", "TRAIN_FACTOR", "StepFlops", "achieved_tflops_per_gpu", "dense_flops_per_token",
           "forward_flops", "gdn_mixing_flops_per_head_token", "language_forward_flops", "language_matmul_params",
           "mfu", "peak_tflops_for", "sequence_mixing_flops", "training_flops", "vision_attention_pairs",
           "vision_forward_flops"]
