"""Cost model and balanced assignment for intra-microbatch reordering (pure: no collectives).

Every function here is a deterministic function of its arguments. That is the whole trick that
lets the vision and language modules agree on one assignment without talking to each other: both
compute the same per-sample costs from fields they both hold (``input_ids``, ``attention_mask``),
all-gather them within their own DP group, and run the same planner over the canonical grid
(``G = lcm`` of the module DP sizes). A module of DP size ``d`` owns ``G / d`` consecutive canonical
groups, so modules of different DP sizes read the same global order at different granularities.

The module reads top to bottom as the exchange uses it: the cost model (the ONE cost formula,
shared by training and ``mimo-sft plan``), balancing (its numpy inner loops are :mod:`balance`),
and the window plan and its statistics (:func:`window_plan_info`). Routing -- who sends which
sample to whom -- is :mod:`routing`; ``exchange.py`` only moves the bytes these modules decide.

Nothing here imports ``torch.distributed`` or megatron, so it is unit-tested without processes.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from mimo_sft.data.reorder import balance
from mimo_sft.errors import UserError

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
#: Absolute slack of the exact solver's pruning (it compares sums of the same costs; integers in
#: practice), so a branch that only ties the best found so far is cut.
_EXACT_EPS = 1e-12


# ---------------------------------------------------------------------------------------------
# cost model
# ---------------------------------------------------------------------------------------------
def _check_weights(encoder_cost_weight: float, language_cost_weight: float) -> None:
    """Weights come straight from flags, so a bad value is the user's to fix (UserError)."""
    if encoder_cost_weight < 0 or language_cost_weight < 0:
        raise UserError(
            f"reorder cost weights must be >= 0, got --reorder-encoder-cost-weight {encoder_cost_weight} "
            f"and --reorder-language-cost-weight {language_cost_weight}"
        )
    if encoder_cost_weight == 0 and language_cost_weight == 0:
        raise UserError(
            "--reorder-encoder-cost-weight and --reorder-language-cost-weight are both 0: make at least one positive"
        )


def patch_counts(input_ids: torch.Tensor, *, image_token_id: int, merge_size: int) -> torch.Tensor:
    """Vision patches per sample, from ``input_ids`` alone.

    Each image placeholder token stands for ``merge_size**2`` patches, so the count is identical on
    ranks that hold pixels and on language-only ranks that never see them.
    ``input_ids`` is ``[S]`` (one sample) or ``[B, S]``; returns an int64 tensor of shape ``[]`` / ``[B]``.
    """
    return (input_ids == image_token_id).sum(dim=-1) * (merge_size * merge_size)


def weighted_costs(
    patches: Sequence[float] | torch.Tensor,
    tokens: Sequence[float] | torch.Tensor | None,
    *,
    encoder_cost_weight: float,
    language_cost_weight: float = 0.0,
) -> list[float]:
    """THE cost formula, per sample: ``encoder_weight * patches + language_weight * real tokens``.

    The single definition: training reaches it through :func:`batch_costs` (counts read from
    ``input_ids`` / ``attention_mask``) and ``mimo-sft plan`` calls it on the same counts taken from
    image headers and token lengths, so the planner cannot drift from what training balances.
    float64 throughout, so the result is bit-identical whichever path the counts came from;
    ``tokens`` is not read when the language weight is 0.
    """
    cost = encoder_cost_weight * torch.as_tensor(patches, dtype=torch.float64)
    if language_cost_weight:
        if tokens is None:
            raise ValueError("language_cost_weight > 0 needs the per-sample token counts")
        cost = cost + language_cost_weight * torch.as_tensor(tokens, dtype=torch.float64)
    return [float(c) for c in cost.tolist()]


def batch_costs(
    fields: Mapping[str, torch.Tensor],
    *,
    encoder_cost_weight: float,
    language_cost_weight: float = 0.0,
    image_token_id: int,
    merge_size: int,
) -> list[float]:
    """Per-sample cost of every sample in a micro-batch: :func:`weighted_costs` of the image
    patches counted in ``input_ids`` and the real tokens counted in ``attention_mask``."""
    _check_weights(encoder_cost_weight, language_cost_weight)
    input_ids = fields["input_ids"]
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    patches = patch_counts(input_ids, image_token_id=image_token_id, merge_size=merge_size)
    tokens = None
    if language_cost_weight:
        mask = fields.get("attention_mask")
        if mask is None:
            raise ValueError("language_cost_weight > 0 needs attention_mask on every rank")
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        tokens = mask.to(torch.float64).sum(dim=-1)
    return weighted_costs(
        patches, tokens, encoder_cost_weight=encoder_cost_weight, language_cost_weight=language_cost_weight
    )


def sample_cost(
    flat_or_fields: Mapping[str, torch.Tensor],
    *,
    encoder_cost_weight: float,
    language_cost_weight: float = 0.0,
    image_token_id: int,
    merge_size: int,
) -> float:
    """Cost of ONE sample: ``encoder_weight * patches + language_weight * real tokens``.

    ``flat_or_fields`` holds that sample's ``input_ids`` (``[S]`` or ``[1, S]``) and, when the
    language weight is positive, its ``attention_mask``. Only fields every module holds are read.
    """
    costs = batch_costs(
        flat_or_fields,
        encoder_cost_weight=encoder_cost_weight,
        language_cost_weight=language_cost_weight,
        image_token_id=image_token_id,
        merge_size=merge_size,
    )
    if len(costs) != 1:
        raise ValueError(f"sample_cost expects one sample, got {len(costs)}; use batch_costs")
    return costs[0]


def make_cost_fn(
    *,
    encoder_cost_weight: float = 1.0,
    language_cost_weight: float = 0.0,
    image_token_id: int,
    merge_size: int,
) -> Callable[[Mapping[str, torch.Tensor]], list[float]]:
    """A ``cost_fn(batch) -> list[float]`` for :class:`ReorderingBuffer`, weights validated once."""
    _check_weights(encoder_cost_weight, language_cost_weight)

    def cost_fn(batch: Mapping[str, torch.Tensor]) -> list[float]:
        return batch_costs(
            batch,
            encoder_cost_weight=encoder_cost_weight,
            language_cost_weight=language_cost_weight,
            image_token_id=image_token_id,
            merge_size=merge_size,
        )

    return cost_fn


def make_patch_count_fn(
    *, image_token_id: int, merge_size: int
) -> Callable[[Mapping[str, torch.Tensor]], list[float]]:
    """A ``load_fn(batch)`` giving per-sample vision patches (for the vision-load statistics)."""

    def load_fn(batch: Mapping[str, torch.Tensor]) -> list[float]:
        ids = batch["input_ids"]
        return [float(c) for c in patch_counts(ids, image_token_id=image_token_id, merge_size=merge_size).tolist()]

    return load_fn


# ---------------------------------------------------------------------------------------------
# balancing
# ---------------------------------------------------------------------------------------------
def _check_grid(n_items: int, n_groups: int) -> int:
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
    per = _check_grid(len(costs), n_groups)
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
    per = _check_grid(len(costs), n_groups)
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
    per = _check_grid(len(costs), n_groups)
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


def window_routes(
    window_costs: Sequence[Sequence[float]], n_groups: int, dp_size: int
) -> list[list[tuple[int, int]]]:
    """Assignments for a window of micro-batches, one per slot: samples never change slot.

    Balancing each slot on its own keeps every micro-batch's sample set (and so its loss
    normalisation and the sampler's resume arithmetic) exactly what it was without reordering.
    """
    if dp_size <= 0 or n_groups % dp_size:
        raise ValueError(f"dp_size {dp_size} must divide the canonical grid {n_groups}")
    return [assignment_from_order(order, dp_size) for order in window_orders(window_costs, n_groups)]


def window_orders(window_costs: Sequence[Sequence[float]], n_groups: int) -> list[list[int]]:
    """The canonical order of every slot of a window, from each slot's GLOBAL costs.

    The one place that decides a window's layout: the exchange (every DP size), the DP-1 local
    permutation and ``mimo-sft plan`` all read their orders from here.
    """
    return [balanced_index_order(costs, n_groups) for costs in window_costs]


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def rank_loads(
    costs: Sequence[float], n_groups: int, dp_size: int, order: Sequence[int] | None = None
) -> list[float]:
    """Per-rank load of a module of size ``dp_size`` when the micro-batch is laid out as ``order``.

    ``order=None`` is the layout before reordering (rank r holds global positions
    ``[r*n/d, (r+1)*n/d)``); pass :func:`balanced_index_order` for the layout after.
    """
    n = len(costs)
    if dp_size <= 0 or n % dp_size:
        raise ValueError(f"{n} samples cannot be split over dp {dp_size}")
    if n_groups % dp_size:
        raise ValueError(f"dp_size {dp_size} must divide the canonical grid {n_groups}")
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of the sample indices")
    per = n // dp_size
    return [float(sum(costs[i] for i in order[r * per : (r + 1) * per])) for r in range(dp_size)]


def loads_before_after(
    loads: Sequence[float], order: Sequence[int], n_groups: int, dp_size: int
) -> tuple[list[float], list[float]]:
    """Per-rank loads of a module of size ``dp_size`` as read (before) and laid out as ``order`` (after)."""
    return rank_loads(loads, n_groups, dp_size), rank_loads(loads, n_groups, dp_size, order)


def load_spread(loads: Sequence[float]) -> dict[str, float]:
    """``max_over_mean`` (1.0 = perfect) and ``max_minus_min`` of per-rank loads."""
    if not loads:
        raise ValueError("no loads")
    mean = sum(loads) / len(loads)
    top = max(loads)
    return {
        "max_over_mean": (top / mean) if mean > 0 else 1.0,
        "max_minus_min": top - min(loads),
        "max": top,
        "mean": mean,
    }


def lower_bound_max_load(costs: Sequence[float], n_groups: int) -> float:
    """A lower bound on the heaviest equal-count group, for inputs too big for the exact solver.

    The average is one bound. A pigeonhole family is the other: among the ``m = (j-1)*G + 1``
    largest items some group holds at least ``j``, so that group weighs at least the ``j`` smallest
    of those ``m`` plus the ``per - j`` smallest of the remaining items, for every ``j`` in ``1..per``.
    """
    per = _check_grid(len(costs), n_groups)
    desc = sorted(costs, reverse=True)
    best = sum(costs) / n_groups
    for j in range(1, per + 1):
        m = (j - 1) * n_groups + 1
        if m > len(desc):
            break
        rest = desc[m:]
        fill = sum(rest[len(rest) - (per - j) :]) if per > j else 0.0
        best = max(best, sum(desc[m - j : m]) + fill)
    return best


def optimal_max_load(costs: Sequence[float], n_groups: int) -> float:
    """Exact minimum heaviest-group load under equal counts (branch and bound; small inputs only).

    Used by tests and the benchmark as the yardstick. Items are placed largest first; empty groups
    are interchangeable, so an item opens at most one new group.
    """
    per = _check_grid(len(costs), n_groups)
    items = sorted(costs, reverse=True)
    groups = balanced_groups(costs, n_groups)
    best = [max(sum(costs[i] for i in g) for g in groups)]
    bound = lower_bound_max_load(costs, n_groups)
    loads = [0.0] * n_groups
    counts = [0] * n_groups
    suffix = [0.0] * (len(items) + 1)
    for k in range(len(items) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + items[k]

    def rec(k: int, cur_max: float) -> None:
        if best[0] <= bound + _EXACT_EPS:
            return
        if k == len(items):
            best[0] = min(best[0], cur_max)
            return
        # remaining mass must fit under best in the free slots' groups
        seen = set()
        for g in range(n_groups):
            if counts[g] >= per:
                continue
            state = (loads[g], counts[g])
            if state in seen:  # identical groups: symmetric branches
                continue
            seen.add(state)
            new = loads[g] + items[k]
            if max(cur_max, new) >= best[0] - _EXACT_EPS:
                continue
            loads[g] += items[k]
            counts[g] += 1
            rec(k + 1, max(cur_max, new))
            loads[g] -= items[k]
            counts[g] -= 1

    rec(0, 0.0)
    return best[0]


# ---------------------------------------------------------------------------------------------
# the window plan: orders and the statistics the buffer logs
# ---------------------------------------------------------------------------------------------
def window_plan_info(
    window_costs: Sequence[Sequence[float]],
    window_loads: Sequence[Sequence[float]],
    *,
    n_groups: int,
    dp_size: int,
    stats_dp_sizes: Mapping[str, int] | None,
) -> list[dict[str, Any]]:
    """Per-slot plan and statistics from the GLOBAL costs/loads of each slot.

    ``order`` is the slot's canonical order (:func:`window_orders`); ``cost_*`` are this module's
    per-rank costs before/after; for each ``name: d`` in ``stats_dp_sizes``, ``{name}_load_*`` are
    per-rank loads (e.g. vision patches) for a module of DP size ``d`` under the same global order —
    what the language rank logs for the vision module.
    """
    out = []
    for costs, loads, order in zip(window_costs, window_loads, window_orders(window_costs, n_groups)):
        info: dict[str, Any] = {"order": order, "global_costs": list(costs)}
        before, after = loads_before_after(costs, order, n_groups, dp_size)
        info["cost_before"], info["cost_after"] = before, after
        sb, sa = load_spread(before), load_spread(after)
        info["cost_max_over_mean_before"] = sb["max_over_mean"]
        info["cost_max_over_mean_after"] = sa["max_over_mean"]
        for name, d in (stats_dp_sizes or {}).items():
            lb, la = loads_before_after(loads, order, n_groups, d)
            info[f"{name}_load_before"], info[f"{name}_load_after"] = lb, la
            b, a = load_spread(lb), load_spread(la)
            info[f"{name}_load_max_over_mean_before"] = b["max_over_mean"]
            info[f"{name}_load_max_over_mean_after"] = a["max_over_mean"]
            info[f"{name}_load_max_minus_min_before"] = b["max_minus_min"]
            info[f"{name}_load_max_minus_min_after"] = a["max_minus_min"]
        out.append(info)
    return out
