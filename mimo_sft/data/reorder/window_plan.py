"""The window plan: each slot's canonical order, its routes, and the statistics the buffer logs (pure).

A window is the micro-batches one exchange carries; every slot is balanced on its own, from its
GLOBAL costs, so samples never change micro-batch. The exchange (every DP size), the DP-1 local
permutation, index mode (``data.indexed``) and ``mimo-sft plan`` all read their orders from
:func:`window_orders` (through :func:`window_plan_info` where they log statistics), so no two paths
can lay a window out differently.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from mimo_sft.data.reorder.assign import assignment_from_order, balanced_index_order
from mimo_sft.data.reorder.load_bounds import load_spread, loads_before_after, module_load_figures


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
        info.update(module_load_figures(loads, order, n_groups, stats_dp_sizes))
        out.append(info)
    return out
