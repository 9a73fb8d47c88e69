"""Measure what autograd keeps for backward: the activation terms of ``mimo_sft.memory`` checked.

Why: a forecast of activation memory is only worth its formulas if the formulas match what the real
layers save. ``saved_bytes`` runs a forward under ``torch.autograd.graph.saved_tensors_hooks`` and
adds up the distinct storages the graph holds (a view and its base count once; parameters and
buffers, which live anyway, are left out). ``language_layer`` builds one megatron decoder layer with
mimo-sft's own spec and config at a checkpoint's real width; ``vision_block`` one transformers
vision block of the checkpoint's family. Both run on the CPU with torch's flash SDPA kernel, the one GPUs use
(the CPU's math fallback would save the ``s x s`` score matrix, which no GPU run keeps).

Used by ``scripts/bench_memory.py`` and the memory tests; not part of training.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import mimo_sft.parallel  # noqa: F401  (makes megatron importable)


class SavedBytes:
    """Distinct storages saved for backward during a forward (``with counter.recording(): ...``)."""

    def __init__(self, exclude=()):
        self._seen: dict[int, int] = {}
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def _pack(self, t: torch.Tensor):
        if t.layout == torch.strided and t.device.type != "meta":
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self._exclude:
                self._seen[ptr] = max(self._seen.get(ptr, 0), st.nbytes())
        return t

    @contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self._seen.values())


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


# ---- one megatron decoder layer ------------------------------------------------------------------
def language_layer(hf_dir: str, *, dtype: torch.dtype, recompute: dict | None = None, pstate=None,
                   extra: dict | None = None):
    """One decoder layer (``TransformerBlock`` with ``num_layers=1``, no final norm) of ``hf_dir``'s
    language model, built as ``model.builder`` builds them (our adapter's config and spec, SDPA core),
    weights not initialised. ``recompute``: TransformerConfig recompute fields (``recompute_granularity``,
    ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``); ``extra``: other config fields
    (``sequence_parallel``). Runs in the 1-rank world (``parallel.bootstrap.start_single_process``), or
    on the tp of ``pstate`` (a ``parallel.groups.ParallelState`` of a ``language=tp=N`` layout)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.parallel.bootstrap import start_single_process

    state = pstate or start_single_process("cpu")
    tp = state.modules["language"].pg_collection.tp.size()
    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    hf_cfg = adapter.load_hf_config(hf_dir, raw)
    hf_cfg.text_config.num_hidden_layers = 1
    overrides = {"calculate_per_token_loss": True, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    overrides.update(recompute or {})
    overrides.update(extra or {})
    # no initialisation (weights left as allocated): what is saved depends on shapes, not values, and a
    # 7B-wide layer then builds in a fraction of the time
    cfg = adapter.language_transformer_config(hf_cfg, tp=tp, pp=1, dtype=dtype, random_init=False, cpu_init=True,
                                              overrides=overrides)
    spec = adapter.block_spec(hf_cfg, 1)
    block = TransformerBlock(cfg, spec, post_layer_norm=False, pg_collection=state.modules["language"].pg_collection)
    return block.to(dtype), cfg


def language_layer_saved(block, cfg, tokens: int, *, dtype: torch.dtype, batch: int = 1) -> int:
    """Bytes one decoder layer saves on this rank for ``batch`` rows of ``tokens`` positions (this rank's
    ``1/tp`` of them under sequence parallelism). The input counts where the layer keeps it (fp32, or
    under full recomputation); the rotary table, shared by every layer, does not."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    h = cfg.hidden_size
    local = tokens // cfg.tensor_model_parallel_size if cfg.sequence_parallel else tokens
    x = torch.randn(local, batch, h, dtype=dtype, requires_grad=True)
    rope = MultimodalRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)
    pos = torch.arange(tokens).view(1, 1, tokens).expand(3, batch, tokens)
    emb = rope(pos, cfg.mrope_section)
    params = list(block.parameters())
    with flash_sdpa():
        total, out = saved_bytes(block, x, None, rotary_pos_emb=emb, exclude=params + [emb])
    return total


# ---- one transformers vision block of the checkpoint's family --------------------------------------
def vision_block(hf_dir: str, *, dtype: torch.dtype):
    """One vision block of ``hf_dir``'s tower (its family's ``vision_block_class``: transformers'
    ``Qwen2_5_VLVisionBlock`` / ``Qwen3VLVisionBlock``), SDPA attention, random weights."""
    import copy

    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family

    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    vcfg = copy.deepcopy(adapter.load_hf_config(hf_dir, raw).vision_config)
    vcfg._attn_implementation = "sdpa"
    return adapter.vision_block_class()(vcfg).to(dtype), vcfg


def vision_block_saved(block, vcfg, patches: int, *, dtype: torch.dtype, recompute: bool = False,
                       window: int | None = None) -> int:
    """Bytes one vision block saves for ``patches`` patches of one image (attention in windows of
    ``window`` patches, default the whole image: a full-attention block); with ``recompute``, under
    non-reentrant ``torch.utils.checkpoint`` as ``--recompute-vision`` runs it."""
    from torch.utils.checkpoint import checkpoint

    head_dim = vcfg.hidden_size // vcfg.num_heads
    x = torch.randn(patches, vcfg.hidden_size, dtype=dtype, requires_grad=True)
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
