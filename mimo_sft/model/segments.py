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

q, k and v are stacked along the heads (one copy) and laid out as padded rows by one ``index_select``
with a host-built index; a pad slot repeats a real row of its segment (finite values that no real query
ever weighs: masked keys, or keys after every real query), so no zero fill and no scatter. Where every
segment fills its row exactly (equal, aligned windows; one segment) the layout is a plain view. The output
comes back with one ``index_select``. Gradients reach exactly the real rows (a pad's is zero), and autograd
keeps only the indices. Extra work: attention over ``segments x width**2`` instead
of the sum of squared lengths (windows are at most 64 patches, so nearly none for windowed blocks;
within a group, at most ``SLACK`` more).
Memory: the padded copy of the stacked q, k, v and the output; the mask is one bool per key slot.

On a GPU in half precision, torch's variable-length attention (``torch.nn.attention.varlen``, flash) takes
the packed tensors and ``cu_seqlens`` as they are -- one call, no padding at all -- where the kernel choice
(``--attention-backend``, :func:`use_kernel`) allows it: ``auto`` picks it where it runs (:func:`varlen_runs`),
``varlen`` asks for it, ``sdpa`` keeps the padded SDPA call everywhere.

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
    """Segments of equal-ish length as rows of one ``[count, width]`` batch (one SDPA call).

    ``positions``: the packed rows of these segments, in order (host int64; default ``0..total-1``): a group of
    a :class:`SegmentBatch` gathers its rows straight from the whole packed tensor."""

    def __init__(self, lengths: Sequence[int], device: torch.device, positions: Optional[torch.Tensor] = None):
        self.total = sum(lengths)
        self.count = len(lengths)
        self.width = _aligned(max(lengths))
        host_lengths = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(host_lengths, 0) - host_lengths
        row = torch.repeat_interleave(torch.arange(self.count), host_lengths)
        offset = torch.arange(self.total) - torch.repeat_interleave(starts, host_lengths)
        #: [total] slot of each of these positions in the flattened [count * width] batch
        self.slots = host_to(row * self.width + offset, device)
        base = torch.arange(self.total) if positions is None else positions
        #: a plain view: every segment fills its row, and the rows are the packed tensor's own, in order
        self.view_only = all(n == self.width for n in lengths) and positions is None
        slot = torch.arange(self.width)[None, :]
        own = starts[:, None] + torch.minimum(slot, host_lengths[:, None] - 1)  # a pad repeats its segment's last row
        #: [count * width] the packed row each slot of the batch reads (None for a plain view)
        self.gather_rows = None if self.view_only else host_to(base[own.reshape(-1)], device)
        keys = slot < host_lengths[:, None]
        #: [count, 1, 1, width] True on real keys (None when no row has padding)
        self.key_mask = None if bool(keys.all()) else host_to(keys[:, None, None, :], device)

    def lay_out(self, qkv: torch.Tensor) -> torch.Tensor:
        """Packed ``[N, h, d]`` (stacked q, k, v heads) -> padded ``[count, h, width, d]``."""
        rows = qkv if self.view_only else qkv.index_select(0, self.gather_rows)
        return rows.view(self.count, self.width, *qkv.shape[1:]).transpose(1, 2)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Padded ``[count, heads, width, d]`` -> packed ``[total, heads, d]`` (pads dropped)."""
        flat = out.transpose(1, 2).reshape(self.count * self.width, out.shape[1], out.shape[3])
        return flat if self.view_only else flat.index_select(0, self.slots)

    def attend_stacked(self, qkv: torch.Tensor, heads: int, *, causal: bool, scale: Optional[float]) -> torch.Tensor:
        """SDPA over these segments of ``qkv [N, heads + 2*groups, d]``: ``[total, heads, d]`` in member order."""
        groups = (qkv.shape[1] - heads) // 2
        q, k, v = self.lay_out(qkv).split([heads, groups, groups], dim=1)
        mask = None if causal else self.key_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=groups != heads)
        return self.gather(out)

    def attend(self, q, k, v, *, causal: bool, scale: Optional[float]) -> torch.Tensor:
        return self.attend_stacked(torch.cat([q, k, v], dim=1), q.shape[1], causal=causal, scale=scale)


class SegmentBatch:
    """The padded-batch layout of segments with these ``lengths`` (host ints), on ``device``: one
    :class:`PaddedRows` group per call (:func:`group_segments`; one group when the lengths are alike), or
    one variable-length call where the kernel choice allows it (:func:`varlen_runs`)."""

    def __init__(self, lengths: Sequence[int], device: torch.device):
        lengths = [int(n) for n in lengths if int(n) > 0]
        assert lengths, "SegmentBatch: no non-empty segment"
        self.total = sum(lengths)
        self.count = len(lengths)
        self.lengths = lengths
        self.device = device
        self._cu_seqlens = None  # int32 bounds on the device, made at the first variable-length call
        members = group_segments(lengths)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        host = ([torch.cat([torch.arange(starts[i], starts[i + 1]) for i in g]) for g in members]
                if len(members) > 1 else [None])
        self.groups = [PaddedRows([lengths[i] for i in g], device, positions=pos) for g, pos in zip(members, host)]
        #: with several groups: where each packed position lands in the groups' concatenated outputs
        self.inverse = host_to(torch.argsort(torch.cat(host)), device) if len(members) > 1 else None

    @property
    def calls(self) -> int:
        """Padded attention calls per use (one per group)."""
        return len(self.groups)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
               scale: Optional[float] = None) -> torch.Tensor:
        """Attention within each segment: packed ``q [total, heads, d]``, ``k/v [total, groups, d]`` (GQA when
        groups < heads) -> ``[total, heads, d]``; no position attends outside its segment."""
        assert q.shape[0] == self.total, f"{q.shape[0]} packed rows, segments cover {self.total}"
        if varlen_runs(q):
            return self._varlen(q, k, v, causal=causal, scale=scale)
        # one layout for the three: one index op per group
        return self.attend_stacked(torch.cat([q, k, v], dim=1), q.shape[1], causal=causal, scale=scale)

    def attend_stacked(self, qkv: torch.Tensor, heads: int, *, causal: bool,
                       scale: Optional[float] = None) -> torch.Tensor:
        """:meth:`attend` of q, k and v stacked along the heads, ``qkv [total, heads + 2 * groups, d]`` (what
        context parallelism's all-to-all delivers: ``model.context_parallel``)."""
        assert qkv.shape[0] == self.total, f"{qkv.shape[0]} packed rows, segments cover {self.total}"
        if varlen_runs(qkv):
            groups = (qkv.shape[1] - heads) // 2
            q, k, v = qkv.split([heads, groups, groups], dim=1)
            return self._varlen(q, k, v, causal=causal, scale=scale)
        outs = [g.attend_stacked(qkv, heads, causal=causal, scale=scale) for g in self.groups]
        return outs[0] if self.inverse is None else torch.cat(outs).index_select(0, self.inverse)

    def cu_seqlens(self) -> torch.Tensor:
        """The bounds as the variable-length kernel takes them: int32 ``[count + 1]`` on the device (copied once)."""
        if self._cu_seqlens is None:
            bounds = torch.tensor([0] + self.lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self._cu_seqlens = host_to(bounds, self.device)
        return self._cu_seqlens

    def _varlen(self, q, k, v, *, causal: bool, scale: Optional[float]) -> torch.Tensor:
        cu = self.cu_seqlens()
        longest = max(self.lengths)
        return varlen_attention(q, k, v, cu, longest, causal=causal, scale=scale)


# ---- the kernel choice --------------------------------------------------------------------------------------
#: ``--attention-backend`` as the segments see it: "auto" (variable-length where it runs), "varlen", "sdpa"
_KERNEL = ["auto"]


def use_kernel(kind: str) -> None:
    """The process's choice for segment attention (``model.builder`` sets it from ``--attention-backend``)."""
    assert kind in ("auto", "varlen", "sdpa"), kind
    _KERNEL[0] = kind


def varlen_function():
    """torch's ``varlen_attn`` where this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_supported(device_type: str, dtype: torch.dtype, head_dim: int, have_varlen: bool = True) -> bool:
    """Where torch's variable-length kernel (flash) runs: a CUDA tensor in half precision, a head dimension it
    takes (a multiple of 8, at most 256), and a torch that has it."""
    return (have_varlen and device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0 and head_dim <= 256)


def varlen_runs(q: torch.Tensor) -> bool:
    """Whether this call takes the variable-length kernel (the kernel choice and :func:`varlen_supported`); a
    ``varlen`` choice where it cannot run is an error, never a silent fallback."""
    kind = _KERNEL[0]
    if kind == "sdpa":
        return False
    ok = varlen_supported(q.device.type, q.dtype, q.shape[-1], varlen_function() is not None)
    if kind == "varlen" and not ok:
        raise RuntimeError(f"--attention-backend varlen cannot run here: it needs a CUDA GPU, --dtype bf16 and a "
                           f"torch with torch.nn.attention.varlen (got {q.device.type}, {q.dtype}, head dim "
                           f"{q.shape[-1]})")
    return ok


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, longest: int, *, causal: bool, scale: Optional[float],
                     kernel=None) -> torch.Tensor:
    """One call of torch's ``varlen_attn`` over packed ``q [T, heads, d]``, ``k/v [T, groups, d]`` (GQA: the
    kernel's own ``enable_gqa`` where this torch has it, else K/V repeated per query head), causal through
    whichever argument this torch's version takes. ``kernel``: the function to call (default torch's)."""
    import inspect

    kernel = kernel or varlen_function()
    params = inspect.signature(kernel).parameters
    kwargs = {"scale": scale}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)
    return kernel(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **kwargs)


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
