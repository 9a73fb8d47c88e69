"""One balanced exchange of a window of micro-batches over a module's DP group.

:func:`exchange_window` is a pipeline of five steps; only two of them talk to other ranks:

1. **gather** (:func:`_gather`, collective): this rank's per-sample costs, stats loads and record
   metadata reach every rank of the module in ONE ``all_gather_object`` on the gloo DP group, and
   every rank checks that all brought the same number of micro-batches and samples;
2. **plan** (:func:`routing.plan_exchange`, pure): the same function of the same numbers on every
   rank — orders over the canonical grid, routes, send/receive lists ordered by
   ``(slot, canonical_pos)``, byte split sizes, whether anything crosses ranks, which slots stay as
   they were — so nobody has to send a plan;
3. **pack** (:func:`_pack`): the samples this rank gives away, serialized into one reused uint8
   buffer in destination order;
4. **all-to-all** (:func:`_all_to_all`, collective): ONE ragged ``all_to_all_single`` with byte
   splits (gloo handles uneven and zero splits; the list form with uneven shapes does not), skipped
   by every rank alike when nothing crosses ranks;
5. **unpack** (:func:`_unpack`): every slot rebuilt in canonical order from kept and received
   records, checking byte counts and that each canonical position is filled exactly once.

A DP-1 module calls :func:`reorder_local` instead: the same orders (:func:`window_plan.window_plan_info`),
applied by indexing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from mimo_sft.data.reorder import routing, serialize, window_plan

CostFn = Callable[[Mapping[str, torch.Tensor]], Sequence[float]]

#: A staging buffer that must grow grows by at least this factor, so a window slightly larger than
#: the last one does not reallocate (and page-fault) tens of MB every time.
_SCRATCH_GROWTH = 1.25
_CPU = torch.device("cpu")


class ScratchBuffers:
    """Send/receive byte buffers reused across windows.

    A freshly allocated tensor of tens of MB costs several times its own copy in page faults
    (measured: 16 ms to clone 39 MB vs 2.3 ms to copy into an existing buffer), so the exchange
    keeps its staging buffers. Safe because every received view is copied by the merge before
    :func:`exchange_window` returns. One instance per thread: never share between concurrent
    exchanges. Holds at most the largest window's bytes per buffer.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            grown = max(nbytes, int(_SCRATCH_GROWTH * buf.numel()) if buf is not None else 0)
            buf = torch.empty(grown, dtype=torch.uint8, device=device)
            self._bufs[key] = buf
        return buf[:nbytes]


def _local_costs(batch: Mapping[str, torch.Tensor], fn: CostFn, n: int, what: str) -> list[float]:
    vals = [float(v) for v in fn(batch)]
    if len(vals) != n:
        raise RuntimeError(f"{what} returned {len(vals)} values for a micro-batch of {n} samples")
    return vals


def _costs_and_loads(
    batches: Sequence[Mapping[str, torch.Tensor]], cost_fn: CostFn, load_fn: CostFn | None
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-slot per-sample costs, and the stats loads (the costs themselves without ``load_fn``)."""
    costs, loads = [], []
    for b in batches:
        n = serialize.batch_size_of(b)
        costs.append(_local_costs(b, cost_fn, n, "cost_fn"))
        loads.append(_local_costs(b, load_fn, n, "load_fn") if load_fn else costs[-1])
    return costs, loads


def reorder_local(
    batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    n_groups: int,
    cost_fn: CostFn,
    load_fn: CostFn | None = None,
    stats_dp_sizes: Mapping[str, int] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """DP-1 module: permute each whole micro-batch into canonical order, no communication.

    With one rank the window's routes are its orders (every sample kept, canonical position =
    index in the order), so the plan is :func:`window_plan.window_plan_info`'s, applied by indexing;
    an identity order (the "slot unchanged" case) returns the batch as it is.
    """
    costs, loads = _costs_and_loads(batches, cost_fn, load_fn)
    infos = window_plan.window_plan_info(costs, loads, n_groups=n_groups, dp_size=1, stats_dp_sizes=stats_dp_sizes)
    out = [serialize.permute_batch(b, info["order"]) for b, info in zip(batches, infos)]
    return out, infos


# ---------------------------------------------------------------------------------------------
# the exchange pipeline
# ---------------------------------------------------------------------------------------------
@dataclass
class _Window:
    """This rank's side of a window: records (views into the batches) and what the plan needs."""

    batches: Sequence[Mapping[str, torch.Tensor]]
    n_local: int
    records: list[list[serialize.Record]]
    metas: list[list[serialize.RecordMeta]]
    costs: list[list[float]]
    loads: list[list[float]]


@dataclass
class _Gathered:
    """Every rank's numbers for the window, indexed ``[rank][slot][local sample]``."""

    costs: list[list[list[float]]]
    loads: list[list[list[float]]]
    metas: list[list[list[serialize.RecordMeta]]]


def _split_window(
    batches: Sequence[Mapping[str, torch.Tensor]], cost_fn: CostFn, load_fn: CostFn | None
) -> _Window:
    n_local = serialize.batch_size_of(batches[0])
    for w, b in enumerate(batches):
        if serialize.batch_size_of(b) != n_local:
            raise RuntimeError(f"micro-batch {w} of the window has {serialize.batch_size_of(b)} samples, expected {n_local}")
    records = [serialize.split_samples(b) for b in batches]
    metas = [[serialize.record_meta(r) for r in recs] for recs in records]
    costs, loads = _costs_and_loads(batches, cost_fn, load_fn)
    return _Window(batches, n_local, records, metas, costs, loads)


def _gather(win: _Window, *, dp_rank: int, dp_size: int, group: Any) -> _Gathered:
    """Step 1: one object all-gather of (slots, samples, costs, loads, metas); ranks must be in step."""
    gathered: list[Any] = [None] * dp_size
    n_slots = len(win.batches)
    dist.all_gather_object(gathered, (n_slots, win.n_local, win.costs, win.loads, win.metas), group=group)
    for r, g in enumerate(gathered):
        if g[0] != n_slots or g[1] != win.n_local:
            raise RuntimeError(
                f"DP rank {r} brought {g[0]} micro-batches of {g[1]} samples, rank {dp_rank} brought "
                f"{n_slots} of {win.n_local}: the ranks' data iterators are out of step"
            )
    return _Gathered(costs=[g[2] for g in gathered], loads=[g[3] for g in gathered], metas=[g[4] for g in gathered])


def _pack(plan: routing.ExchangePlan, win: _Window, scratch: ScratchBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: serialize what leaves this rank, destination by destination; size the receive buffer."""
    leaving = [(w, i) for dst, moves in enumerate(plan.send) if dst != plan.dp_rank for w, _pos, i in moves]
    send_buf = serialize.serialize_records(
        [win.records[w][i] for w, i in leaving],
        [win.metas[w][i] for w, i in leaving],
        out=scratch.get("send", sum(plan.send_splits), _CPU),  # serialize checks the byte count
    )
    return send_buf, scratch.get("recv", sum(plan.recv_splits), _CPU)


def _all_to_all(plan: routing.ExchangePlan, send_buf: torch.Tensor, recv_buf: torch.Tensor, group: Any) -> None:
    """Step 4: one ragged all-to-all, or nothing when no sample crosses ranks (every rank agrees)."""
    if plan.crosses:
        dist.all_to_all_single(
            recv_buf, send_buf, output_split_sizes=plan.recv_splits, input_split_sizes=plan.send_splits, group=group
        )
    else:
        assert recv_buf.numel() == 0 and send_buf.numel() == 0, "nothing crosses ranks, yet bytes are staged"


def _unpack(
    plan: routing.ExchangePlan, win: _Window, gathered: _Gathered, recv_buf: torch.Tensor
) -> list[dict[str, torch.Tensor]]:
    """Step 5: place kept and received records at their canonical positions; merge each slot."""
    n_local = win.n_local
    slots: list[list[serialize.Record | None]] = [[None] * n_local for _ in win.batches]

    def place(w: int, pos: int, rec: serialize.Record, src: int) -> None:
        if not 0 <= pos < n_local:
            raise RuntimeError(f"canonical position {pos} from DP rank {src} is outside 0..{n_local - 1}")
        if slots[w][pos] is not None:
            raise RuntimeError(f"micro-batch {w} position {pos} filled twice (second from DP rank {src})")
        slots[w][pos] = rec

    for w, pos, i in plan.kept:
        place(w, pos, win.records[w][i], plan.dp_rank)
    off = 0
    for src, moves in enumerate(plan.recv):
        if src == plan.dp_rank or not moves:
            continue
        recs, end = serialize.deserialize_records(recv_buf, [gathered.metas[src][w][i] for w, _p, i in moves], off)
        if end - off != plan.recv_splits[src]:
            raise RuntimeError(f"DP rank {src} sent {end - off} bytes of samples, expected {plan.recv_splits[src]}")
        for (w, pos, _i), rec in zip(moves, recs):
            place(w, pos, rec, src)
        off = end
    if off != recv_buf.numel():
        raise RuntimeError(f"received {recv_buf.numel()} bytes but decoded {off}")
    out = []
    for w, (slot, batch) in enumerate(zip(slots, win.batches)):
        missing = [p for p, r in enumerate(slot) if r is None]
        if missing:
            raise RuntimeError(f"micro-batch {w}: canonical positions {missing} received no sample")
        # a slot that kept exactly its own samples in their own order needs no copy
        out.append(dict(batch) if plan.unchanged[w] else serialize.merge_samples(slot))  # type: ignore[arg-type]
    return out


def exchange_window(
    batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    dp_rank: int,
    dp_size: int,
    n_groups: int,
    cost_fn: CostFn,
    group: Any,
    load_fn: CostFn | None = None,
    stats_dp_sizes: Mapping[str, int] | None = None,
    scratch: ScratchBuffers | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """Balance ``batches`` (this rank's shards of W micro-batches) across the DP group.

    ``group`` is a gloo DP group: it carries the small object all-gather and the sample bytes, which
    are host tensors at both ends (the forward step moves a micro-batch to the GPU).
    Returns this rank's W rebalanced micro-batches (CPU tensors, slot order kept) and per-slot info
    from :func:`window_plan.window_plan_info` plus ``exchange_s`` for the whole window. ``scratch``
    reuses staging buffers across calls (see :class:`ScratchBuffers`).
    """
    t0 = time.perf_counter()
    if not batches:
        raise ValueError("exchange_window needs at least one micro-batch")
    sent = 0
    if dp_size == 1:
        out, infos = reorder_local(
            batches, n_groups=n_groups, cost_fn=cost_fn, load_fn=load_fn, stats_dp_sizes=stats_dp_sizes
        )
    else:
        win = _split_window(batches, cost_fn, load_fn)
        gathered = _gather(win, dp_rank=dp_rank, dp_size=dp_size, group=group)
        nbytes = [[[serialize.record_nbytes(m) for m in slot] for slot in rank] for rank in gathered.metas]
        plan = routing.plan_exchange(
            gathered.costs, gathered.loads, nbytes, dp_rank=dp_rank, n_groups=n_groups, stats_dp_sizes=stats_dp_sizes
        )
        send_buf, recv_buf = _pack(plan, win, ScratchBuffers() if scratch is None else scratch)
        _all_to_all(plan, send_buf, recv_buf, group)
        out, infos = _unpack(plan, win, gathered, recv_buf), plan.infos
        sent = int(send_buf.numel()) if plan.crosses else 0
    dt = time.perf_counter() - t0
    for info in infos:
        info["exchange_s"] = dt
        info["window_bytes_sent"] = sent  # what this rank sent to other ranks for the whole window
    return out, infos
