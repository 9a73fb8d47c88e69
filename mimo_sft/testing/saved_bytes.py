"""Measure what autograd keeps for backward: the activation terms of ``mimo_sft.memory`` checked.

Why: a forecast of activation memory is only worth its formulas if the formulas match what the real
layers save. ``saved_bytes`` runs a forward under ``torch.autograd.graph.saved_tensors_hooks`` and
adds up the distinct storages the graph holds (a view and its base count once; parameters and
buffers, which live anyway, are left out). ``language_layer`` builds one megatron decoder layer with
mimo-sft's own spec and config at a checkpoint's real width; ``vision_block`` one transformers
vision block of the checkpoint's family. Both run on the CPU with torch's flash SDPA kernel, the one GPUs use
(the CPU's math fallback would save the ``s x s`` score matrix, which no GPU run keeps). Likewise a
Qwen3.5 Gated DeltaNet layer's three kernels keep what fla's GPU kernels keep, not what autograd would
keep of their torch stand-ins (``fla_saved_tensors``); megatron's ``jit_fuser`` helpers around them run
under torch.compile as on a GPU. torch's RMSNorm, one fused kernel on CUDA, can take CUDA's dispatch path
(``cuda_rms_norm_saved_tensors``: the ``device="cuda"`` figures; torch's own autograd node for that kernel
keeps the tensors, with torch's reference of the kernel standing in for the CUDA one, which cannot run here).

Used by ``scripts/bench_memory.py`` and the memory tests; not part of training.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

import mimo_sft.parallel  # noqa: F401  (makes megatron importable)


class SavedBytes:
    """Distinct storages saved for backward during a forward (``with counter.recording(): ...``).

    Sizes are read when asked (``total``), not when saved: megatron's ``CheckpointWithoutOutput``
    (selective ``gdn_norm_out``) empties a saved output's storage once the next layer has used it."""

    def __init__(self, exclude=()):
        self._seen: dict[int, torch.UntypedStorage] = {}
        self._exclude = {t.untyped_storage()._cdata for t in exclude}

    def _pack(self, t: torch.Tensor):
        # keyed by the storage itself (held here, so its key is never reused), not by its address: a
        # freed storage's address can come back for a later tensor
        if t.layout == torch.strided and t.device.type != "meta":
            st = t.untyped_storage()
            if st._cdata not in self._exclude:
                self._seen.setdefault(st._cdata, st)
        return t

    @contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(st.nbytes() for st in self._seen.values())


def saved_bytes(fn, *args, exclude=(), **kwargs) -> tuple[int, object]:
    """``(bytes saved for backward by fn(*args), fn's output)``; ``exclude``: tensors not to count
    (parameters, and the inputs whose memory the caller accounts for elsewhere)."""
    counter = SavedBytes(exclude=exclude)
    with counter.recording():
        out = fn(*args, **kwargs)
    return counter.total, out


@contextmanager
def flash_sdpa():
    """torch's flash SDPA kernel (CPU and GPU): what the forecast's attention terms describe."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


# ---- fla's saved tensors, for the Gated DeltaNet kernels' stand-ins ----------------------------------
class _MeasureOnly(torch.autograd.Function):
    """Base of the three measurement Functions: their forward keeps what fla's keeps; no backward."""

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("testing.saved_bytes: fla's saved tensors are counted here, not differentiated")


class _FlaConv(_MeasureOnly):
    """fla's ``CausalConv1dFunction`` keeps its input (a view of the in_proj output) and the weight; the
    SiLU is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, cu_seqlens):
        from mimo_sft.model import gdn_kernels as gk

        ctx.save_for_backward(x, weight, bias)
        return gk.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens)[0]


class _FlaL2Norm(_MeasureOnly):
    """fla's ``L2NormFunction`` keeps its output and fp32 ``1 / ||x||`` per row."""

    @staticmethod
    def forward(ctx, x, eps, output_dtype):
        from mimo_sft.model import gdn_kernels as gk

        y = gk.l2norm(x, eps=eps, output_dtype=output_dtype)
        rstd = torch.rsqrt(x.float().pow(2).sum(-1) + eps)
        ctx.save_for_backward(y, rstd)
        return y


class _FlaChunkRule(_MeasureOnly):
    """fla 0.4's ``ChunkGatedDeltaRuleFunction`` (``use_qk_l2norm_in_kernel`` off, as megatron calls it)
    keeps q, k, v and beta as given, g's chunk-local cumulative sum (fp32, ``g``'s shape) and the inverted
    intra-chunk matrix ``A`` (``[B, T, H, 64]`` in k's dtype); both allocated at those shapes here (what
    is saved depends on shapes, not values, as for ``language_layer``'s uninitialised weights)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, cu_seqlens):
        from mimo_sft.model import gdn_kernels as gk

        o, _ = gk.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)
        g_cumsum = torch.empty_like(g, dtype=torch.float32)
        a = k.new_empty(*k.shape[:3], gk.CHUNK)
        ctx.save_for_backward(q, k, v, g_cumsum, beta, a)
        return o.to(q.dtype)  # fla returns q's dtype


@torch.compiler.disable
def _fla_conv(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, **_):
    assert initial_state is None and not output_final_state, "measured as megatron's GatedDeltaNet calls it"
    return _FlaConv.apply(x, weight, bias, activation, cu_seqlens), None


@torch.compiler.disable
def _fla_l2norm(x, eps: float = 1e-6, output_dtype=None):
    return _FlaL2Norm.apply(x, eps, output_dtype)


@torch.compiler.disable
def _fla_chunk_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    assert initial_state is None and not output_final_state and not use_qk_l2norm_in_kernel
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return _FlaChunkRule.apply(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                               scale, cu_seqlens), None


@contextmanager
def fla_saved_tensors(block):
    """While measuring ``block``: its Gated DeltaNet layers' three kernels keep what fla's keep.

    Why: GPUs run fla's triton ``causal_conv1d``, ``l2norm`` and ``chunk_gated_delta_rule``, autograd
    Functions that keep a few tensors and recompute the rest in backward; on the CPU the layer runs
    ``model.gdn_kernels``' torch stand-ins, whose every chunk intermediate autograd would keep. Each
    kernel is swapped for a Function that computes the stand-in's output without a graph and saves
    exactly fla's tensors (a no-op where fla itself is installed, or the block has no GDN layer). The
    kernels stay out of torch.compile (megatron compiles the helpers around ``l2norm``), as fla's
    autograd Functions are opaque to its partitioner.
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, common, gdn

    from mimo_sft.model import gdn_kernels as gk

    layers = [m for m in block.modules() if isinstance(m, GatedDeltaNet)]
    if not layers or common.chunk_gated_delta_rule is not gk.chunk_gated_delta_rule:
        yield
        return
    before = gdn.causal_conv1d, common.l2norm, [m.gated_delta_rule for m in layers]
    gdn.causal_conv1d, common.l2norm = _fla_conv, _fla_l2norm
    for m in layers:
        m.gated_delta_rule = _fla_chunk_rule
    try:
        yield
    finally:
        gdn.causal_conv1d, common.l2norm = before[0], before[1]
        for m, rule in zip(layers, before[2]):
            m.gated_delta_rule = rule


# ---- torch's fused CUDA RMSNorm, for the device="cuda" figures --------------------------------------
@contextmanager
def cuda_rms_norm_saved_tensors():
    """While measuring: torch's RMSNorm takes the path it takes on CUDA, so its autograd node keeps what it
    keeps on a GPU.

    Why: CUDA torch's ``rms_norm`` calls the ``_fused_rms_norm`` op, whose CUDA kernel is one fused kernel
    and whose autograd node (``FusedRmsNormBackward0``, torch's derivatives.yaml) keeps the input as given,
    the weight and the per-row rstd; the CPU build has no kernel for that op, so it falls back to the
    composite, whose every step autograd records (fp32 copies). Here the op gets a CPU kernel for the
    duration -- torch's own reference of the CUDA kernel, its decomposition (``torch._decomp``: the one fake
    tensors use; rstd in fp32 for bf16, as the CUDA kernel's accumulate type) -- so ``rms_norm`` dispatches
    exactly as on CUDA (the composite still where CUDA takes it: channels-last, complex, a weight of another
    dtype) and torch's real autograd node records the saved tensors. Only ``rms_norm`` changes: torch's
    RMSNorm and Qwen3.5's zero-centred norms (one ``F.rms_norm`` over an fp32 copy) take the fused op,
    the towers' norms (transformers' composites) stay composites."""
    from torch._decomp import decomposition_table
    from torch.library import Library

    aten = torch.ops.aten
    forward_ref = decomposition_table[aten._fused_rms_norm.default]
    backward_ref = decomposition_table[aten._fused_rms_norm_backward.default]

    def forward(x, normalized_shape, weight, eps):
        with torch._C._AutoDispatchBelowAutograd():
            return forward_ref(x, normalized_shape, weight, eps)

    def backward(grad, x, normalized_shape, rstd, weight, mask):
        with torch._C._AutoDispatchBelowAutograd():
            return backward_ref(grad, x, normalized_shape, rstd, weight, mask)

    lib = Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", forward, "CPU")
    lib.impl("_fused_rms_norm_backward", backward, "CPU")
    try:
        yield
    finally:
        lib._destroy()


# ---- one megatron decoder layer ------------------------------------------------------------------
def language_layer(hf_dir: str, *, dtype: torch.dtype, recompute: dict | None = None, pstate=None,
                   extra: dict | None = None, layer_type: str | None = None, num_layers: int = 1):
    """One decoder layer (``TransformerBlock`` with ``num_layers=1``, no final norm) of ``hf_dir``'s
    language model, built as ``model.builder`` builds them (our adapter's config and spec, SDPA core),
    weights not initialised. ``recompute``: TransformerConfig recompute fields (``recompute_granularity``,
    ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``); ``extra``: other config fields
    (``sequence_parallel``); ``layer_type``: a hybrid decoder's layer kind (``text_config.layer_types``
    entry, default its first layer's). megatron's fused SwiGLU is on or off as the forecast counts it
    (``memory.activations.FUSED_SWIGLU``, which tests hold equal to the model's own config) unless ``extra`` sets
    ``bias_activation_fusion``. Runs in the 1-rank world (``parallel.bootstrap.start_single_process``),
    or on the tp of ``pstate`` (a ``parallel.groups.ParallelState`` of a ``language=tp=N`` layout). The
    block carries ``rotary_percent`` (the rotary share of each head) for ``language_layer_saved``. ``num_layers``:
    a block of that many such layers (``testing.cp_measure``)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.parallel.bootstrap import start_single_process
    from mimo_sft.parallel.megatron_patches import swiglu_uncompiled

    swiglu_uncompiled()  # the fused SwiGLU as every model runs it (uncompiled)
    state = start_single_process("cpu") if pstate is None else pstate
    tp = state.modules["language"].pg_collection.tp.size()
    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    hf_cfg = adapter.load_hf_config(hf_dir, raw)
    text = hf_cfg.text_config
    if getattr(text, "layer_types", None):  # one layer, of the kind asked for
        text.layer_types = [layer_type or text.layer_types[0]] * num_layers
    text.num_hidden_layers = num_layers
    from mimo_sft.memory.activations import FUSED_SWIGLU

    overrides = {"calculate_per_token_loss": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
                 "bias_activation_fusion": FUSED_SWIGLU}
    overrides.update(recompute or {})
    overrides.update(extra or {})
    # no initialisation (weights left as allocated, a router aside: _init_routers): what is saved depends on shapes, not values, and a
    # 7B-wide layer then builds in a fraction of the time
    cfg = adapter.language_transformer_config(hf_cfg, tp=tp, pp=1, dtype=dtype, random_init=False, cpu_init=True,
                                              overrides=overrides)
    spec = adapter.block_spec(hf_cfg, num_layers)
    block = TransformerBlock(cfg, spec, post_layer_norm=False, pg_collection=state.modules["language"].pg_collection)
    block = block.to(dtype)
    _init_routers(block)
    block.rotary_percent = float((getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))
    return block, cfg


def _init_routers(block) -> None:
    """A mixture-of-experts layer's routers (and shared-expert gates) drawn from N(0, 0.02), seeded: what its
    layer saves depends on where tokens are routed, and uninitialised weights route every token alike (or
    produce NaNs); the experts' weights, whose values change no shape, stay as allocated."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith(("router.weight", "shared_experts.gate_weight")):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def language_layer_saved(block, cfg, tokens: int, *, dtype: torch.dtype, batch: int = 1, device: str = "cpu",
                         segments: list[int] | None = None) -> int:
    """Bytes one decoder layer saves on this rank for ``batch`` rows of ``tokens`` positions (this rank's
    ``1/tp`` of them under sequence parallelism), or for one packed sequence of ``segments`` (samples' lengths,
    summing to ``tokens``: in-batch packing's THD input, each sample's positions from 0, attention per sample as
    ``model.attention`` runs it). The input counts where the layer keeps it (fp32, or
    under full recomputation, or as the input of CUDA's fused RMSNorm); the rotary table, shared by every
    layer, does not. A Gated DeltaNet layer's kernels keep what fla's keep (``fla_saved_tensors``);
    ``device="cuda"``: torch's RMSNorms keep what its fused CUDA kernel keeps (``cuda_rms_norm_saved_tensors``)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    h = cfg.hidden_size
    local = tokens // cfg.tensor_model_parallel_size if cfg.sequence_parallel else tokens
    x = torch.randn(local, batch, h, dtype=dtype, requires_grad=True)
    rope = MultimodalRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=getattr(block, "rotary_percent", 1.0))
    pos = torch.arange(tokens).view(1, 1, tokens).expand(3, batch, tokens)
    extra = {}
    if segments is not None:
        assert batch == 1 and sum(segments) == tokens, f"segments cover {sum(segments)} tokens, not {tokens}"
        pos = torch.cat([torch.arange(n) for n in segments]).view(1, 1, tokens).expand(3, 1, tokens)
        extra["packed_seq_params"] = packed_params(segments)
    emb = rope(pos, cfg.mrope_section)
    params = list(block.parameters())
    from mimo_sft.model.gdn_binding import compiled_helpers

    norms = cuda_rms_norm_saved_tensors() if device == "cuda" else nullcontext()
    with flash_sdpa(), fla_saved_tensors(block), compiled_helpers(), norms:  # megatron's compiled helpers, as on a GPU
        total, out = saved_bytes(block, x, None, rotary_pos_emb=emb, exclude=params + [emb], **extra)
    return total


def packed_params(segments: list[int]):
    """megatron's ``PackedSeqParams`` of one packed sequence of ``segments``, as ``train.packing`` builds them."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments), 0)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=max(segments),
                           max_seqlen_kv=max(segments))


# ---- one transformers vision block of the checkpoint's family --------------------------------------
def vision_block(hf_dir: str, *, dtype: torch.dtype):
    """One vision block of ``hf_dir``'s tower (its family's ``vision_block_class``: transformers'
    ``Qwen2_5_VLVisionBlock`` / ``Qwen3VLVisionBlock``) with training's attention (one SDPA call over
    all windows or images: ``model.vision_attention``), random weights."""
    import copy

    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.model.vision_attention import SEGMENT_ATTENTION

    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    vcfg = copy.deepcopy(adapter.load_hf_config(hf_dir, raw).vision_config)
    vcfg._attn_implementation = SEGMENT_ATTENTION
    return adapter.vision_block_class()(vcfg).to(dtype), vcfg


def image_segments(vcfg, grids) -> tuple[list[int], list[int]]:
    """``(windows, images)``: the attention segment lengths, in patches, of images with these ``grids``
    (``[t, h, w]`` patches each) as transformers' Qwen2.5-VL tower lays them out -- its windows
    (``window_size`` pixels a side; partial at image edges) for windowed blocks, whole images for
    full-attention blocks (and every block of a tower without windows)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from mimo_sft.model.segments import lengths_of

    grid = torch.tensor(grids, dtype=torch.int64)
    images = lengths_of(get_vision_cu_seqlens(grid).tolist())
    if not getattr(vcfg, "window_size", None):
        return images, images
    _, cu_window = get_vision_window_index(grid, spatial_merge_size=vcfg.spatial_merge_size,
                                           window_size=vcfg.window_size, patch_size=vcfg.patch_size)
    return [n for n in lengths_of(cu_window.tolist()) if n], images


def vision_block_saved(block, vcfg, patches: int, *, dtype: torch.dtype, recompute: bool = False,
                       window: int | None = None, segments: list[int] | None = None) -> int:
    """Bytes one vision block saves for ``patches`` patches of one image (attention in windows of
    ``window`` patches, default the whole image: a full-attention block), or in ``segments`` (lengths
    in patches, summing to ``patches``: several images' windows or images, ``image_segments``); with
    ``recompute``, under non-reentrant ``torch.utils.checkpoint`` as ``--recompute-vision`` runs it."""
    from torch.utils.checkpoint import checkpoint

    head_dim = vcfg.hidden_size // vcfg.num_heads
    x = torch.randn(patches, vcfg.hidden_size, dtype=dtype, requires_grad=True)
    if segments is not None:
        assert sum(segments) == patches, f"segments cover {sum(segments)} patches, not {patches}"
        bounds = [0]
        for n in segments:
            bounds.append(bounds[-1] + n)
    else:
        window = window or patches
        bounds = list(range(0, patches, window)) + [patches]
    cu = torch.tensor(bounds, dtype=torch.int32)
    angles = torch.randn(patches, head_dim // 2)
    emb = torch.cat([angles, angles], dim=-1)
    pos = (emb.cos(), emb.sin())
    params = list(block.parameters())

    def run(t):
        return block(t, cu_seqlens=cu, position_embeddings=pos)

    fn = (lambda t: checkpoint(run, t, use_reentrant=False)) if recompute else run
    with flash_sdpa():
        total, _ = saved_bytes(fn, x, exclude=params + [*pos])
    return total


def projector_modules(hf_dir: str, *, dtype: torch.dtype) -> list:
    """The mergers of ``hf_dir``'s vision tower (its family's ``projector_modules``: the patch merger, then
    Qwen3-VL's DeepStack mergers), random weights."""
    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family

    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    return [m.to(dtype) for m in adapter.projector_modules(adapter.load_hf_config(hf_dir, raw).vision_config)]
