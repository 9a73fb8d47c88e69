"""Routing for one window of the exchange (pure): what one DP rank sends and receives.

Both ends of every transfer derive the same lists from the same window plan
(:func:`window_plan.window_plan_info`), so no routing message is ever sent: :func:`plan_exchange`
gives each rank its send and receive lists, the byte split sizes of the all-to-all, whether any
sample crosses ranks at all, and which slots stay exactly as they were. ``exchange.py`` moves the
bytes; nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mimo_sft.data.reorder.assign import assignment_from_order
from mimo_sft.data.reorder.window_plan import window_plan_info

#: One sample's move inside a window: ``(slot, canonical position on the receiver, local index on
#: the sender)``. Sorting by it gives the order bytes travel in, which sender and receiver share.
Move = tuple[int, int, int]


def global_slots(per_rank: Sequence[Sequence[Sequence[Any]]]) -> list[list[Any]]:
    """``per_rank[r][w]`` (rank ``r``'s values for slot ``w``) -> ``out[w]``, ranks concatenated.

    Global index ``g = r * n_local + i`` of local sample ``i`` on rank ``r``: the layout before
    reordering, which :func:`rank_loads` and :func:`assignment_from_order` assume.
    """
    if not per_rank:
        return []
    n_slots = len(per_rank[0])
    return [[v for rank in per_rank for v in rank[w]] for w in range(n_slots)]


def rank_moves(
    routes: Sequence[Sequence[tuple[int, int]]], *, dp_rank: int, dp_size: int, n_local: int
) -> tuple[list[list[Move]], list[list[Move]]]:
    """``(send, recv)``: ``send[dst]`` are this rank's samples that ``dst`` holds after reordering,
    ``recv[src]`` the samples this rank gets from ``src``; ``recv[dp_rank] == send[dp_rank]`` is
    what it keeps. Each list sorted by (slot, position), so ``send[q]`` on rank ``r`` equals
    ``recv[r]`` on rank ``q``: the order of the bytes on the wire.
    """
    send: list[list[Move]] = [[] for _ in range(dp_size)]
    recv: list[list[Move]] = [[] for _ in range(dp_size)]
    for w, route in enumerate(routes):
        if len(route) != dp_size * n_local:
            raise ValueError(f"slot {w} routes {len(route)} samples, expected {dp_size} x {n_local}")
        for g, (owner, pos) in enumerate(route):
            src, i = divmod(g, n_local)
            if src == dp_rank:
                send[owner].append((w, pos, i))
            if owner == dp_rank:
                recv[src].append((w, pos, i))
    for moves in send + recv:
        moves.sort()
    return send, recv


def split_sizes(
    send: Sequence[Sequence[Move]],
    recv: Sequence[Sequence[Move]],
    nbytes: Sequence[Sequence[Sequence[int]]],
    *,
    dp_rank: int,
) -> tuple[list[int], list[int]]:
    """Byte split sizes of the ragged all-to-all: ``(send_splits, recv_splits)``, one per peer.

    ``nbytes[r][w][i]`` is the serialized size of rank ``r``'s local sample ``i`` of slot ``w``
    (every rank knows every size from the gathered metadata). What a rank keeps does not travel, so
    its own entry is 0 on both sides.
    """
    send_splits = [
        0 if dst == dp_rank else sum(nbytes[dp_rank][w][i] for w, _pos, i in moves)
        for dst, moves in enumerate(send)
    ]
    recv_splits = [
        0 if src == dp_rank else sum(nbytes[src][w][i] for w, _pos, i in moves)
        for src, moves in enumerate(recv)
    ]
    return send_splits, recv_splits


def crosses_ranks(routes: Sequence[Sequence[tuple[int, int]]], n_local: int) -> bool:
    """Whether any sample of the window changes rank. Every rank knows every route, so all agree to
    skip the collective when none does."""
    return any(owner != g // n_local for route in routes for g, (owner, _pos) in enumerate(route))


def unchanged_slots(routes: Sequence[Sequence[tuple[int, int]]], *, dp_rank: int, n_local: int) -> list[bool]:
    """Per slot: does ``dp_rank`` end up with exactly its own samples, each at its own index?

    Such a slot needs no copy: the rank's micro-batch is already in canonical order.
    """
    return [
        all(g // n_local == dp_rank and pos == g % n_local for g, (owner, pos) in enumerate(route) if owner == dp_rank)
        for route in routes
    ]


@dataclass(frozen=True)
class ExchangePlan:
    """Everything one DP rank needs to run a window's exchange, derived from the gathered numbers.

    ``infos``: :func:`window_plan_info` per slot; ``routes``: ``(owner, canonical_pos)`` per global
    sample per slot; ``send`` / ``recv``: :func:`rank_moves`; ``send_splits`` / ``recv_splits``:
    :func:`split_sizes`; ``crosses``: :func:`crosses_ranks`; ``unchanged``: :func:`unchanged_slots`.
    """

    dp_rank: int
    n_local: int
    infos: list[dict[str, Any]]
    routes: list[list[tuple[int, int]]]
    send: list[list[Move]]
    recv: list[list[Move]]
    send_splits: list[int]
    recv_splits: list[int]
    crosses: bool
    unchanged: list[bool]

    @property
    def kept(self) -> list[Move]:
        """The moves this rank makes to itself (no bytes travel)."""
        return self.recv[self.dp_rank]


def plan_exchange(
    costs: Sequence[Sequence[Sequence[float]]],
    loads: Sequence[Sequence[Sequence[float]]],
    nbytes: Sequence[Sequence[Sequence[int]]],
    *,
    dp_rank: int,
    n_groups: int,
    stats_dp_sizes: Mapping[str, int] | None = None,
) -> ExchangePlan:
    """The whole routing of one window for ``dp_rank``, from every rank's numbers.

    ``costs[r][w][i]``, ``loads[r][w][i]``, ``nbytes[r][w][i]``: rank ``r``'s local sample ``i`` of
    slot ``w`` (what the all-gather returns). Every rank calls this with the same numbers and gets
    the same orders and routes; only its own send/receive lists differ.
    """
    dp_size = len(costs)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"DP rank {dp_rank} outside a group of {dp_size}")
    n_slots = len(costs[dp_rank])
    if n_slots == 0:
        raise ValueError("a window needs at least one slot")
    n_local = len(costs[dp_rank][0])
    for name, table in (("costs", costs), ("loads", loads), ("nbytes", nbytes)):
        if len(table) != dp_size or any(len(t) != n_slots or any(len(v) != n_local for v in t) for t in table):
            raise ValueError(f"{name} must be {dp_size} ranks x {n_slots} slots x {n_local} samples")
    infos = window_plan_info(
        global_slots(costs), global_slots(loads), n_groups=n_groups, dp_size=dp_size, stats_dp_sizes=stats_dp_sizes
    )
    routes = [assignment_from_order(info["order"], dp_size) for info in infos]
    send, recv = rank_moves(routes, dp_rank=dp_rank, dp_size=dp_size, n_local=n_local)
    send_splits, recv_splits = split_sizes(send, recv, nbytes, dp_rank=dp_rank)
    return ExchangePlan(
        dp_rank=dp_rank,
        n_local=n_local,
        infos=infos,
        routes=routes,
        send=send,
        recv=recv,
        send_splits=send_splits,
        recv_splits=recv_splits,
        crosses=crosses_ranks(routes, n_local),
        unchanged=unchanged_slots(routes, dp_rank=dp_rank, n_local=n_local),
    )
