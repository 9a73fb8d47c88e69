"""The language model's core attention: torch's ``scaled_dot_product_attention``, padded or packed.

megatron's local ``DotProductAttention`` materialises the full ``[b, heads, s, s]`` score matrix
(slow and memory-hungry on GPUs) and refuses packed sequences; its fast paths need Transformer
Engine. ``SDPAttention`` is a drop-in core for megatron's layer spec (same constructor and forward
contract, ``attention.CoreAttentionInterface``) that hands the work to SDPA: flash or
memory-efficient kernels on CUDA, the math kernel on CPU, so CI runs the code GPUs run.

Two input formats, as megatron's ``Attention`` passes them:

* ``sbhd`` (padded rows): ``q [s, b, heads, d]``, ``k/v [s, b, groups, d]`` -> ``[s, b, heads*d]``.
  Causal; right padding means real tokens never see pads, so no mask is needed.
* ``thd`` (in-batch packing, ``packed_seq_params.qkv_format == "thd"``): ``q [t, heads, d]`` holding
  several samples back to back, split by ``cu_seqlens_q``. The samples are laid out as rows of one
  padded batch (``model.segments``) and attended in one causal SDPA call per layer: no token attends
  across samples, no ``t x t`` mask is built, and the flash kernel stays eligible on GPUs. The
  layout is built once per forward from host ``cu_seqlens`` and shared by every layer.

Under context parallelism (``language=...,cp=N``) the packed rows hold this rank's zigzag share of every document
and ``packed_seq_params`` carries the micro-batch's split: the core exchanges q, k and v with its cp group and
attends over whole documents (``model.context_parallel.ulysses_attention``).

GQA uses SDPA's ``enable_gqa`` (no repeated K/V copies). No attention dropout: training builds the
language model with ``attention_dropout=0`` (``train.setup``), so a dropout path here would never run
in a test; a training forward with dropout asked for fails loudly instead of silently skipping it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from mimo_sft.model.context_parallel import ulysses_attention
from mimo_sft.model.segments import SegmentBatch, segments_of

#: the ``--attention-backend`` choices: ours (its segment kernel picked in ``model.segments``: ``auto``, ``sdpa``,
#: ``varlen``), and megatron's local core (the reference)
BACKENDS = ("auto", "sdpa", "varlen", "local")


def core_backend(backend: str) -> str:
    """The core this backend builds: megatron's local one, or ours ("sdpa", whose segments pick their kernel)."""
    assert backend in BACKENDS, f"unknown attention backend {backend!r}; choices: {BACKENDS}"
    return "local" if backend == "local" else "sdpa"


class SDPAttention(MegatronModule):
    """Causal core attention on ``F.scaled_dot_product_attention``; see the module docstring."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        assert config.window_size is None, "SDPAttention: sliding-window attention is not supported"
        assert getattr(config, "softmax_type", "vanilla") == "vanilla", "SDPAttention: only the vanilla softmax"
        assert attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal), (
            f"SDPAttention is causal only, got {attn_mask_type}")
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        #: context parallelism (``model.context_parallel``): cp shares the heads of this rank in its all-to-all
        self.cp = config.context_parallel_size
        assert self.heads % self.cp == 0, (
            f"SDPAttention: cp={self.cp} does not divide the {self.heads} query heads per tp rank (check 16)")
        # megatron's query-key layer scaling divides the scale by the layer number and multiplies the
        # scores back inside its softmax: the net scale is the plain one
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Nothing to checkpoint: the core has no parameters or buffers."""
        return {}

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, heads, s, d]`` causal attention (``k``/``v`` may have fewer heads: GQA)."""
        assert not (self.training and self.dropout_p > 0), (
            f"SDPAttention: attention dropout {self.dropout_p} is not supported (training uses attention_dropout=0)")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=self.groups != self.heads)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: Optional[PackedSeqParams] = None):
        assert attention_mask is None, (
            "SDPAttention takes no attention mask: rows are right-padded (causal attention never sees the "
            "pads) or packed (cu_seqlens)")
        assert attention_bias is None, "SDPAttention: attention bias is not supported"
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        assert self.cp == 1, "SDPAttention under context parallelism runs packed rows only (train.packing)"
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        out = self._sdpa(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def _packed(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """One causal SDPA call over every ``cu_seqlens`` segment (``model.segments``)."""
        assert not (self.training and self.dropout_p > 0), (
            f"SDPAttention: attention dropout {self.dropout_p} is not supported (training uses attention_dropout=0)")
        segments = packed_segments(params, query.device)
        split = getattr(params, "_mimo_cp", None)
        if self.cp > 1:  # this rank holds 1/cp of the positions (model.context_parallel)
            assert split is not None and split.cp == self.cp, (
                "SDPAttention under context parallelism needs the micro-batch's split (train.step sets it)")
            assert segments.total == query.shape[0] * self.cp, (
                f"cu_seqlens cover {segments.total} tokens, cp={self.cp} ranks hold {query.shape[0]} each")
            return ulysses_attention(query, key, value, split, segments, scale=self.scale)
        assert segments.total == query.shape[0], (
            f"cu_seqlens cover {segments.total} tokens, the packed sequence has {query.shape[0]}")
        out = segments.attend(query, key, value, causal=True, scale=self.scale)
        return out.reshape(query.shape[0], self.heads * self.head_dim)


def packed_segments(params: PackedSeqParams, device: torch.device) -> SegmentBatch:
    """The segment layout of a forward's ``PackedSeqParams``, built once and shared by every layer.

    ``cu_seqlens`` stay on the host (the forward step never moves them): megatron's THD rotary reads
    them with ``.tolist()`` / ``.item()`` in every layer, host reads that cost no device sync, and the
    layout's one index is copied to the device once per forward, here.
    """
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    segments = getattr(params, "_segments", None)
    if segments is None:
        assert cu_q is not None and torch.equal(cu_q, cu_kv), "SDPAttention: self-attention needs cu_seqlens_q == kv"
        segments = segments_of(cu_q, device)
        params._segments = segments
    return segments


def core_attention_class(backend: str):
    """The core-attention module for ``--attention-backend``."""
    if core_backend(backend) == "sdpa":
        return SDPAttention
    assert backend == "local", f"unknown attention backend {backend!r}; choices: {BACKENDS}"
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention
