"""Context parallelism (``language=...,cp=N``): each rank of a cp group computes a zigzag share of every document.

Why this shape: megatron-core 0.19.2 does context parallelism only inside Transformer Engine's attention (CUDA);
its local attention refuses cp > 1 and packed rows, and torch's ``context_parallel`` takes neither the CPU nor
variable lengths. So the split is ours, Ulysses-style around the SDPA segment core (``model.segments``):

* **The split** (built on the host by the forward step, ``train.packing.pack_documents``): the micro-batch is one
  packed sequence (THD) whose documents are each padded to a multiple of ``2 * cp``; document ``d`` of padded
  length ``L`` is cut into ``2 * cp`` chunks of ``L / (2 cp)`` and rank ``r`` holds chunks ``r`` and
  ``2 cp - 1 - r`` (:func:`zigzag_positions`: the chunks TE's ``thd_get_partitioned_indices`` gives, the ones
  megatron's THD rotary (``_get_thd_freqs_on_this_cp_rank``) and Gated DeltaNet (``_build_thd_cp_a2a_perm``)
  assume), so causal work is balanced. :class:`ContextSplit` holds this rank's positions (one host-built index,
  copied once) and applies it to the combined embeddings, labels and loss mask (:class:`ContextParallelMixin`)
  and DeepStack's rows (``model.deepstack``). The mRoPE positions stay whole: megatron's rotary computes the
  angles of the whole packed sequence and its THD path picks each document's two chunks with the same rule.
* **Attention** (:func:`ulysses_attention`): q, k, v of this rank's positions ``[T/cp, heads]`` are exchanged
  by one all-to-all into ``[T, heads/cp]`` (every position, this rank's share of the heads), put back in packed
  order by one index, attended per document on the global ``cu_seqlens`` (one segment call), and sent back the
  same way. cp must divide the query heads per tensor-parallel rank; key/value heads are repeated where cp does
  not divide them (check 16 refuses the rest before step 0).
* **Gradients**: every language parameter's gradient is partial on each cp rank and megatron's DDP reduces over
  dp x cp (``intra_dp_cp``). The encoder's rows are whole on every cp rank (each gets them from the bridge as a
  tensor-parallel rank would); their gradient is summed over cp on the language side
  (:meth:`ContextParallelMixin.over_cp`), so the bridge and the encoder see the single-process gradient, as from
  replicated tensor-parallel ranks.
* **Bridges**: megatron's ``BridgeCommunicator`` and ``ColocatedBridgeCommunicator`` refuse a cp dimension. They
  only need to know which ranks hold one DP replica; :func:`mimo_sft.parallel.groups.folded_grid` gives them the
  language grid with cp folded into tp (the same ranks, the same replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mimo_sft.parallel.runtime import host_to


def zigzag_positions(lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Host int64 ``[sum(lengths) / cp]``: the packed positions rank ``rank`` of ``cp`` holds, documents in order,
    each document's chunk ``rank`` then chunk ``2 cp - 1 - rank`` (every length a multiple of ``2 cp``)."""
    parts, start = [], 0
    for n in lengths:
        assert n % (2 * cp) == 0, f"a document of {n} positions does not split into {2 * cp} chunks"
        c = n // (2 * cp)
        if c:
            parts += [torch.arange(start + rank * c, start + (rank + 1) * c),
                      torch.arange(start + n - (rank + 1) * c, start + n - rank * c)]
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def kv_repeat(heads: int, groups: int, cp: int) -> int:
    """How many times each key/value head is repeated so that cp divides them and they still divide the query
    heads (GQA): 1 where cp divides ``groups`` already, at most ``heads / groups`` (one per query head)."""
    assert heads % cp == 0 and heads % groups == 0, (heads, groups, cp)
    r = 1
    while (groups * r) % cp or heads % (groups * r):
        r += 1
    return r


@dataclass
class ContextSplit:
    """One micro-batch's split over a cp group (module docstring); indexes built on the host, copied once."""

    cp: int
    rank: int
    group: object  # the cp process group (its all-to-alls and gradient sums)
    lengths: list  # padded document lengths of the packed sequence (each a multiple of 2*cp)
    local_host: torch.Tensor  # int64 [T/cp]: this rank's packed positions, in its local order
    local: torch.Tensor  # the same, on the device
    natural: torch.Tensor  # [T] device: row of the all-to-all's output (ranks' positions in rank order) per position
    gathered: torch.Tensor  # [T] device: position of each row of that rank order (the inverse permutation)

    @classmethod
    def build(cls, lengths: Sequence[int], *, cp: int, rank: int, group, device) -> "ContextSplit":
        lengths = [int(n) for n in lengths]
        per_rank = [zigzag_positions(lengths, cp, r) for r in range(cp)]
        order = torch.cat(per_rank)
        assert order.numel() == sum(lengths)
        natural = torch.argsort(order)
        return cls(cp=cp, rank=rank, group=group, lengths=lengths, local_host=per_rank[rank],
                   local=host_to(per_rank[rank], device), natural=host_to(natural, device),
                   gathered=host_to(order, device))

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Host int64: each packed position's slot in this rank's local sequence, -1 where another rank holds it."""
        slot = torch.full((self.total,), -1, dtype=torch.int64)
        slot[self.local_host] = torch.arange(self.local_host.numel())
        return slot[positions]

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` cut to this rank's positions along ``dim`` (the packed sequence's dimension)."""
        assert x.shape[dim] == self.total, f"{x.shape[dim]} positions along dim {dim}, the split covers {self.total}"
        return x.index_select(dim, self.local)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: ContextSplit, segments,
                      *, scale: Optional[float]) -> torch.Tensor:
    """Causal attention of this rank's positions ``query [T/cp, heads, d]``, ``key/value [T/cp, groups, d]`` over
    whole documents: ``[T/cp, heads * d]``. ``segments``: the ``model.segments.SegmentBatch`` of the global
    ``cu_seqlens``. One all-to-all each way carries q, k and v stacked along the heads (module docstring)."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    cp = split.cp
    t_local, heads, d = query.shape
    assert heads % cp == 0, f"cp={cp} does not divide the {heads} query heads of this rank (check 16)"
    r = kv_repeat(heads, key.shape[1], cp)
    if r > 1:
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
    hq, hk = heads // cp, key.shape[1] // cp
    width = hq + 2 * hk
    stacked = torch.cat([query.reshape(t_local, cp, hq, d), key.reshape(t_local, cp, hk, d),
                         value.reshape(t_local, cp, hk, d)], dim=2)  # [T/cp, cp (head share), width, d]
    send = stacked.transpose(0, 1).reshape(cp * t_local, width * d)
    recv = all_to_all(split.group, send)  # block j: rank j's positions, this rank's heads
    qkv = recv.view(cp * t_local, width, d).index_select(0, split.natural)  # packed order
    out = segments.attend_stacked(qkv, hq, causal=True, scale=scale)  # [T, hq, d]
    back = out.index_select(0, split.gathered).reshape(cp * t_local, hq * d)
    back = all_to_all(split.group, back)  # block j: this rank's positions, rank j's heads
    return back.view(cp, t_local, hq, d).transpose(0, 1).reshape(t_local, heads * d)


class ContextParallelMixin:
    """For a ``MimoModel`` subclass: this micro-batch's :class:`ContextSplit` applied where megatron's
    ``PartitionAdapter`` would shard (its THD path needs Transformer Engine), the encoder rows' gradient summed
    over cp, and megatron's colocated bridge built on the language grid with cp folded into tp."""

    _cp_split: Optional[ContextSplit] = None

    def set_context_split(self, split: Optional[ContextSplit]) -> None:
        """The next forward's split (the forward step sets it for every micro-batch; None at cp 1)."""
        self._cp_split = split

    def _build_packed_seq_params(self, packing_kwargs):
        params = super()._build_packed_seq_params(packing_kwargs)
        if params is not None and self._cp_split is not None:
            params._mimo_cp = self._cp_split  # the attention core's all-to-all (model.attention)
        return params

    def _shard_language_inputs(self, embeddings, labels, loss_mask, packed_seq_params=None):
        split = self._cp_split
        if split is None:
            return super()._shard_language_inputs(embeddings, labels, loss_mask, packed_seq_params)
        assert packed_seq_params is not None and packed_seq_params.qkv_format == "thd", (
            "context parallelism runs on one packed sequence (train.packing.pack_documents)")
        labels = split.take(labels, 1) if labels is not None else None
        loss_mask = split.take(loss_mask, 1) if loss_mask is not None else None
        if embeddings is not None:
            embeddings = split.take(embeddings, 0)  # [T/cp, 1, H]
            adapter = self.partition_adapter
            if adapter is not None and adapter.cfg.seq_parallel:
                from megatron.core import tensor_parallel

                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings,
                                                                                 group=adapter.cfg.tp_group)
        return embeddings, labels, loss_mask, packed_seq_params

    def over_cp(self, rows: torch.Tensor) -> torch.Tensor:
        """An encoder's rows as they enter the language model: unchanged, with their gradient summed over cp
        (each cp rank backpropagates only the rows its positions hold)."""
        split = self._cp_split
        if split is None or split.cp == 1 or not rows.requires_grad:
            return rows
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(rows, group=split.group)

    def _build_colocated_communicators(self):
        from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY

        grids = self.mimo_config.module_to_grid_map
        lang = grids.get(MIMO_LANGUAGE_MODULE_KEY) if grids else None
        if lang is None or lang.shape[lang.dim_names.index("cp")] == 1:
            return super()._build_colocated_communicators()
        from mimo_sft.parallel.groups import folded_grid

        self.mimo_config.module_to_grid_map = {**grids, MIMO_LANGUAGE_MODULE_KEY: folded_grid(lang)}
        try:
            return super()._build_colocated_communicators()
        finally:
            self.mimo_config.module_to_grid_map = grids
