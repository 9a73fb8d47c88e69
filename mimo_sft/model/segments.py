"""Variable-length segments of a packed tensor as one padded batch: one attention call for all of them.

Why: packed rows (the language model's in-batch packing, the vision tower's windows and images) hold
several independent segments back to back, marked by ``cu_seqlens``. Calling SDPA once per segment
costs one kernel launch per window per block (about 4,700 calls for one 2 Mpx page) plus a
host read of the bounds; a dense ``[N, N]`` block-diagonal mask over all patches of a 4 Mpx page
would be 16k x 16k. Instead every segment is copied into its own row of a ``[segments, width]``
batch (``width``: the longest segment, rounded up to a multiple of 8 for the GPU kernels'
alignment), attended in one ``scaled_dot_product_attention`` call, and copied back:

* non-causal (vision): a key mask ``[segments, 1, 1, width]`` hides each row's padding (no mask at
  all when every segment fills its row); pad queries see real keys, stay finite, and are dropped;
* causal (language): pads sit after each row's real tokens, so causal attention never lets a real
  token see them and no mask is needed (the flash kernel stays eligible on GPUs).

The copies are ``index_put`` into zeros and ``index_select`` back with one host-built index, so
gradients flow to exactly the real rows, and autograd keeps only that index for them (``index_copy``
would also keep its source: 3 more bytes x hidden per patch per block). Extra work: attention over ``segments x width**2`` instead
of the sum of squared lengths (windows are at most 64 patches, so nearly none for windowed blocks;
within a group, at most ``SLACK`` more).
Memory: the padded copies of q, k, v and the output; the mask is one bool per key slot.

Segments of very different lengths are not padded to the longest: :func:`group_segments` splits them
into a few groups (one call each) whose padded attention work stays within ``1 + SLACK`` of the exact
work, so a long-tailed micro-batch costs a few calls instead of up to ``segments`` times the FLOPs.

The bounds are read from the host once per ``cu_seqlens`` tensor: callers that hold host lengths
attach them (:func:`attach_segments`); otherwise the first use reads the tensor once and caches
the batch layout on it, so the 32 blocks of a tower (or every layer of a forward) share one read.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

# a host tensor on the device, asynchronously (pinned on CUDA): every index and mask here is built on the host
from mimo_sft.parallel.runtime import host_to  # noqa: F401  (re-exported for the model's other host-built inputs)

#: row width granularity (GPU attention kernels want head-dim and sequence alignment to 8)
ALIGN = 8
_ATTR = "_mimo_segments"


#: how much more attention work (padded score entries over the exact sum of squared lengths) a group of
#: segments may do before the longest ones get a call of their own
SLACK = 0.25
#: padded work (score entries per head) below which a group never splits: at 512 x 512 a call costs
#: about its launch, so fewer calls win whatever the padding
SMALL_WORK = 512 * 512


def group_segments(lengths: Sequence[int], slack: float = SLACK) -> list[list[int]]:
    """Indexes of ``lengths`` in groups, each padded to its longest member in one attention call, such that
    each group's padded work ``members x width**2`` stays within ``1 + slack`` of its exact work (or
    under :data:`SMALL_WORK`, where launches cost more than the padding).

    Longest first, greedily: equal windows (vision) and similar lengths make one group; a long-tailed
    micro-batch (one 8k sample among short ones, a 4 Mpx page beside thumbnails) makes a few, instead of
    padding every short segment to the longest (up to ``segments`` times the work). Members keep their
    packed order inside a group. Pure: host ints in, host ints out."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    exact = 0
    for i in order:
        n = lengths[i]
        if groups:
            width = _aligned(lengths[groups[-1][0]])
            padded = (len(groups[-1]) + 1) * width * width
            if padded <= (1 + slack) * (exact + n * n) or padded <= SMALL_WORK:
                groups[-1].append(i)
                exact += n * n
                continue
        groups.append([i])
        exact = n * n
    return [sorted(g) for g in groups]


def _aligned(n: int) -> int:
    return math.ceil(n / ALIGN) * ALIGN


class PaddedRows:
    """Segments of equal-ish length as rows of one ``[count, width]`` batch (one SDPA call)."""

    def __init__(self, lengths: Sequence[int], device: torch.device):
        self.total = sum(lengths)
        self.count = len(lengths)
        self.width = _aligned(max(lengths))
        host_lengths = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(host_lengths, 0) - host_lengths
        row = torch.repeat_interleave(torch.arange(self.count), host_lengths)
        offset = torch.arange(self.total) - torch.repeat_interleave(starts, host_lengths)
        #: [total] slot of each of these positions in the flattened [count * width] batch
        self.slots = host_to(row * self.width + offset, device)
        full = all(n == self.width for n in lengths)
        keys = torch.arange(self.width)[None, :] < host_lengths[:, None]
        #: [count, 1, 1, width] True on real keys (None when no row has padding)
        self.key_mask = None if full else host_to(keys[:, None, None, :], device)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[total, heads, d]`` -> padded ``[count, heads, width, d]`` (zeros in the pads)."""
        assert x.shape[0] == self.total, f"{x.shape[0]} packed rows, segments cover {self.total}"
        padded = x.new_zeros((self.count * self.width,) + tuple(x.shape[1:])).index_put((self.slots,), x)
        return padded.view(self.count, self.width, *x.shape[1:]).transpose(1, 2)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Padded ``[count, heads, width, d]`` -> packed ``[total, heads, d]`` (pads dropped)."""
        flat = out.transpose(1, 2).reshape(self.count * self.width, out.shape[1], out.shape[3])
        return flat.index_select(0, self.slots)

    def attend(self, q, k, v, *, causal: bool, scale: Optional[float]) -> torch.Tensor:
        mask = None if causal else self.key_mask
        out = F.scaled_dot_product_attention(self.scatter(q), self.scatter(k), self.scatter(v), attn_mask=mask,
                                             is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return self.gather(out)


class SegmentBatch:
    """The padded-batch layout of segments with these ``lengths`` (host ints), on ``device``: one
    :class:`PaddedRows` group per call (:func:`group_segments`; one group when the lengths are alike)."""

    def __init__(self, lengths: Sequence[int], device: torch.device):
        lengths = [int(n) for n in lengths if int(n) > 0]
        assert lengths, "SegmentBatch: no non-empty segment"
        self.total = sum(lengths)
        self.count = len(lengths)
        members = group_segments(lengths)
        self.groups = [PaddedRows([lengths[i] for i in g], device) for g in members]
        #: with several groups: each group's packed positions, and where each packed position lands in
        #: the groups' concatenated outputs (host-built, moved once)
        self.positions: list[torch.Tensor] = []
        self.inverse: Optional[torch.Tensor] = None
        if len(members) > 1:
            starts = [0]
            for n in lengths:
                starts.append(starts[-1] + n)
            host = [torch.cat([torch.arange(starts[i], starts[i + 1]) for i in g]) for g in members]
            self.positions = [host_to(p, device) for p in host]
            self.inverse = host_to(torch.argsort(torch.cat(host)), device)

    @property
    def calls(self) -> int:
        """Attention calls per use (one per group)."""
        return len(self.groups)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
               scale: Optional[float] = None) -> torch.Tensor:
        """One SDPA call per group over every segment: packed ``q [total, heads, d]``, ``k/v [total, groups,
        d]`` (GQA when groups < heads) -> ``[total, heads, d]``; no position attends outside its segment."""
        assert q.shape[0] == self.total, f"{q.shape[0]} packed rows, segments cover {self.total}"
        if self.inverse is None:
            return self.groups[0].attend(q, k, v, causal=causal, scale=scale)
        outs = [g.attend(*(t.index_select(0, pos) for t in (q, k, v)), causal=causal, scale=scale)
                for g, pos in zip(self.groups, self.positions)]
        return torch.cat(outs).index_select(0, self.inverse)


def lengths_of(cu_seqlens: Sequence[int]) -> list[int]:
    """Segment lengths of host bounds ``[0, c1, ..., N]``."""
    bounds = [int(b) for b in cu_seqlens]
    assert bounds and bounds[0] == 0 and all(b <= e for b, e in zip(bounds, bounds[1:])), f"bad cu_seqlens {bounds}"
    return [e - b for b, e in zip(bounds, bounds[1:])]


def attach_segments(cu_seqlens: torch.Tensor, host_bounds: Sequence[int]) -> torch.Tensor:
    """Give the (device) ``cu_seqlens`` tensor its batch layout from bounds the caller holds on the host."""
    setattr(cu_seqlens, _ATTR, SegmentBatch(lengths_of(host_bounds), cu_seqlens.device))
    return cu_seqlens


def segments_of(cu_seqlens: torch.Tensor, device: Optional[torch.device] = None) -> SegmentBatch:
    """The batch layout of ``cu_seqlens`` (on ``device``, default the tensor's): attached or cached on the
    tensor, else read from it once (a host read; a device sync when the tensor lives on a GPU)."""
    batch = getattr(cu_seqlens, _ATTR, None)
    if batch is None:
        batch = SegmentBatch(lengths_of(cu_seqlens.tolist()), device or cu_seqlens.device)
        setattr(cu_seqlens, _ATTR, batch)
    return batch
