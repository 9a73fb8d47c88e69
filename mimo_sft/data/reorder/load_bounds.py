"""Per-rank loads of a laid-out micro-batch, their spread, and bounds on the best heaviest group (pure).

Why apart from :mod:`assign`: these measure a layout rather than make one. The buffer's statistics
and ``mimo-sft plan`` read loads and spreads from here (:func:`rank_loads`, :func:`load_spread`); the
tests and ``scripts/bench_reorder.py`` judge the balancing against :func:`lower_bound_max_load` and
the exact :func:`optimal_max_load`.
"""

from __future__ import annotations

from typing import Sequence

from mimo_sft.data.reorder.assign import balanced_groups, check_grid

#: Absolute slack of the exact solver's pruning (it compares sums of the same costs; integers in
#: practice), so a branch that only ties the best found so far is cut.
_EXACT_EPS = 1e-12


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
    per = check_grid(len(costs), n_groups)
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
    per = check_grid(len(costs), n_groups)
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


def module_load_figures(loads, order, n_groups: int, stats_dp_sizes) -> dict:
    """Each module's per-rank loads before and after a plan's ``order`` and their spread
    (``<module>_load_before/_after``, ``_load_max_over_mean_*``, ``_load_max_minus_min_*``), for every module
    in ``stats_dp_sizes`` (name -> its DP size): the figures a window's plan and a colocated plan report alike."""
    out = {}
    for name, d in (stats_dp_sizes or {}).items():
        lb, la = loads_before_after(loads, order, n_groups, d)
        out[f"{name}_load_before"], out[f"{name}_load_after"] = lb, la
        b, a = load_spread(lb), load_spread(la)
        out[f"{name}_load_max_over_mean_before"] = b["max_over_mean"]
        out[f"{name}_load_max_over_mean_after"] = a["max_over_mean"]
        out[f"{name}_load_max_minus_min_before"] = b["max_minus_min"]
        out[f"{name}_load_max_minus_min_after"] = a["max_minus_min"]
    return out
