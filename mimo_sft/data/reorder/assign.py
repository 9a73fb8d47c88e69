"""Equal-count balanced assignment of one micro-batch to the canonical grid (pure: no collectives).

Every function here is a deterministic function of its arguments. That is the whole trick that
lets the vision and language modules agree on one assignment without talking to each other: both
compute the same per-sample costs (:mod:`cost_model`), all-gather them within their own DP group,
and run the same balancing over the canonical grid (``G = lcm`` of the module DP sizes). A module
of DP size ``d`` owns ``G / d`` consecutive canonical groups, so modules of different DP sizes read
the same global order at different granularities.

Plain LPT (the baseline), the search behind :func:`balanced_groups` (its numpy inner loops are
:mod:`balance`), the canonical order it lays out and the ``(owner rank, position)`` per sample that
order gives a module. Windows of micro-batches are :mod:`window_plan`; per-rank loads and the
bounds the tests and benchmark measure against are :mod:`load_bounds`.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Sequence

import numpy as np

from mimo_sft.data.reorder import balance

#: Relative slack below which a swap is not counted as an improvement. Guards the refinement loop
#: against float round-off ping-pong; costs are usually integers, where it never matters.
_IMPROVE_EPS = 1e-12
#: Work cap of one start's improvement, in candidate swaps examined: ``_WORK_PER_ITEM * n +
#: _WORK_MIN``, linear in the micro-batch. Bimodal image costs converge at 100-300 per sample
#: (``scripts/bench_reorder.py``, table d), so the cap only bounds unlucky inputs.
_WORK_PER_ITEM = 1024
_WORK_MIN = 1 << 16
#: Up to this many samples the as-read layout and plain LPT are refined too (the partner search
#: is exhaustive with <= 16 groups), as before issue 16: cheap there, and sometimes better.
_SMALL_ITEMS = 64
#: Above ``_SMALL_ITEMS``, groups of at most this many samples start from LPT (it ends 0.1-1 %
#: lighter there), larger ones from differencing (it ends 0.03-0.06 % lighter and faster).
_LPT_START_MAX_PER = 4


def check_grid(n_items: int, n_groups: int) -> int:
    """Samples per canonical group; ValueError when the micro-batch does not split into equal groups."""
    if n_groups <= 0:
        raise ValueError(f"n_groups must be positive, got {n_groups}")
    if n_items % n_groups:
        raise ValueError(
            f"{n_items} samples cannot be split into {n_groups} equal canonical groups (micro_batch_size "
            "must be a multiple of the canonical grid, the LCM of the module DP sizes)"
        )
    return n_items // n_groups


def _as_costs(costs: Sequence[float] | Any) -> np.ndarray:
    """The costs as one flat fp64 array, whatever holds them (list, tuple, tensor, numpy array)."""
    return np.asarray(costs, dtype=np.float64).reshape(-1)


def lpt_equal_count(costs: Sequence[float], n_groups: int) -> list[list[int]]:
    """Plain equal-count LPT: heaviest item first onto the lightest group that still has room.

    Ties go to the lower item index and the lower group index, so the result is deterministic.
    A heap of ``(load, group)`` over the groups with room: ``O(n log n)``. Kept public as the
    baseline the benchmark compares against, and as one start of the small-case search.
    """
    per = check_grid(len(costs), n_groups)
    c = _as_costs(costs)
    vals = c.tolist()
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    if per == 0:
        return groups
    heap = [(0.0, g) for g in range(n_groups)]  # sorted, hence a heap
    for i in np.argsort(-c, kind="stable").tolist():  # heaviest first, ties by index
        load, g = heap[0]
        groups[g].append(i)
        if len(groups[g]) < per:
            heapq.heapreplace(heap, (load + vals[i], g))
        else:
            heapq.heappop(heap)
    return groups


def _balanced_grid(costs: Sequence[float], n_groups: int) -> tuple[np.ndarray, list[balance.Work]]:
    """The search behind :func:`balanced_groups`: ``([n_groups, per] grid, work per start)``.

    1. The layout as read is returned untouched when its heaviest group already sits on the lower
       bound ``max(sum / groups, max cost)`` (nothing can beat it, and nothing moves; with
       negative costs the second term counts the lightest partners the largest item can get).
    2. Starts: on small micro-batches (``n <=`` :data:`_SMALL_ITEMS`, where all of this is cheap)
       the as-read layout, plain LPT and balanced largest differencing
       (:func:`balance.differencing_start`); on larger ones only one: differencing, or LPT with at
       most :data:`_LPT_START_MAX_PER` samples per group, whichever ends better there on bimodal
       costs (``scripts/bench_reorder.py``). The as-read start would need about one swap per
       misplaced sample and practically never wins at that size.
    3. The last start is improved by batched heavy/light pair swaps alternating with the swap
       refinement (:func:`balance.improve`), the others by the refinement alone
       (:func:`balance.refine_swaps`); each under a work budget linear in ``n``.
    The lightest heaviest group wins; ties keep the earlier start (as read, LPT, differencing), so
    an as-read layout that is as good as anything found does not move.
    """
    per = check_grid(len(costs), n_groups)
    c = _as_costs(costs)
    n = len(c)
    ident = np.arange(n, dtype=np.int64).reshape(n_groups, per)
    if n_groups == 1 or per == 0:
        return ident, []
    eps = _IMPROVE_EPS * max(1.0, float(np.abs(c).max()))
    # lower bounds: the mean group, and the group of the largest item (its partners weigh >= min)
    with_top = float(c.max()) + (per - 1) * min(0.0, float(c.min()))
    stop_at = max(math.fsum(c.tolist()) / n_groups, with_top) + eps
    if balance.heaviest(c, ident) <= stop_at:
        return ident, []
    if n <= _SMALL_ITEMS:
        lpt = np.array(lpt_equal_count(c, n_groups), dtype=np.int64)
        starts = [ident, lpt, balance.differencing_start(c, n_groups)]
    elif per <= _LPT_START_MAX_PER:
        starts = [np.array(lpt_equal_count(c, n_groups), dtype=np.int64)]
    else:
        starts = [balance.differencing_start(c, n_groups)]
    works = []
    for k, grid in enumerate(starts):
        work = balance.Work(budget=_WORK_PER_ITEM * n + _WORK_MIN)
        if k == len(starts) - 1:
            balance.improve(c, grid, work, eps, stop_at)
        else:
            balance.refine_swaps(c, grid, work, eps, stop_at)
        works.append(work)
    if len(starts) == 1:
        return starts[0], works
    tops = [balance.heaviest(c, grid) for grid in starts]
    return starts[tops.index(min(tops))], works


def balanced_groups(costs: Sequence[float], n_groups: int, *, refine: bool = True) -> list[list[int]]:
    """Equal-count groups of item indices with a small heaviest group (each group sorted by index).

    ``refine=False`` is plain LPT; otherwise :func:`_balanced_grid` (differencing start, pair
    swaps, heaviest-group swap refinement; more starts on small inputs), ``O(n log n)``-ish with a
    work cap linear in ``n``. Sorting inside each group keeps the sender's relative order.
    """
    per = check_grid(len(costs), n_groups)
    best = _balanced_grid(costs, n_groups)[0].tolist() if refine else lpt_equal_count(costs, n_groups)
    for grp in best:
        grp.sort()
    assert all(len(grp) == per for grp in best), "equal-count invariant broken"
    return best


def balanced_index_order(costs: Sequence[float], n_groups: int) -> list[int]:
    """A permutation of ``range(len(costs))`` laid out group by group, ``len/n_groups`` per group.

    Canonical group ``g`` is ``order[g*per:(g+1)*per]``. Groups are ordered by their smallest
    original index, so that with balanced input the order stays close to the identity.
    """
    groups = balanced_groups(costs, n_groups)
    groups.sort(key=lambda grp: grp[0] if grp else -1)
    order = [i for grp in groups for i in grp]
    if sorted(order) != list(range(len(costs))):
        raise AssertionError(f"balanced_index_order produced a non-permutation: {order}")
    return order


def balanced_assignment(costs: Sequence[float], n_groups: int, dp_size: int) -> list[tuple[int, int]]:
    """``(owner_rank, canonical_pos)`` for every global sample index of one micro-batch.

    Rank ``r`` of a module of size ``dp_size`` owns canonical groups ``[r*G/d, (r+1)*G/d)``, i.e.
    positions ``[r*n/d, (r+1)*n/d)`` of :func:`balanced_index_order`; ``canonical_pos`` is the
    sample's index inside that rank's slice.
    """
    if dp_size <= 0 or n_groups % dp_size:
        raise ValueError(f"dp_size {dp_size} must divide the canonical grid {n_groups}")
    return assignment_from_order(balanced_index_order(costs, n_groups), dp_size)


def assignment_from_order(order: Sequence[int], dp_size: int) -> list[tuple[int, int]]:
    """``(owner_rank, canonical_pos)`` per sample index from a canonical order (see above)."""
    n = len(order)
    if dp_size <= 0 or n % dp_size:
        raise ValueError(f"{n} samples cannot be split over dp {dp_size}")
    per_rank = n // dp_size
    out: list[tuple[int, int] | None] = [None] * n
    for k, idx in enumerate(order):
        if not 0 <= idx < n or out[idx] is not None:
            raise ValueError(f"order {list(order)} is not a permutation")
        out[idx] = (k // per_rank, k % per_rank)
    return out  # type: ignore[return-value]
