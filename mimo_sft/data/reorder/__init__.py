"""Intra-microbatch reordering: balance per-sample vision load across a module's DP ranks.

Pure planning imports no collectives, so every module computes the same plan from the same costs
without talking to the others: :mod:`.cost_model` (per-sample costs, the one formula), :mod:`.assign`
(equal-count balancing onto the canonical grid; kernels in :mod:`.balance`), :mod:`.window_plan`
(each window's orders, routes and logged statistics), :mod:`.load_bounds` (per-rank loads, spread,
lower bound and exact optimum), :mod:`.routing` (where every sample goes) and, on colocated layouts,
:mod:`.colocated_plan` (the per-GPU plan; its swap kernel :mod:`.coupled`). Byte packing
(:mod:`.serialize`) is pure too; :mod:`.exchange` only moves bytes: the one all-gather + one ragged
all-to-all per window; :mod:`.buffer` wraps the data iterator (optionally overlapping the next
window's exchange on a background thread). Index mode (``data.indexed``) moves no sample: its one
collective is :mod:`.cost_gather`, the all-gather of each rank's shard costs.
"""

from mimo_sft.data.reorder.assign import (
    assignment_from_order,
    balanced_assignment,
    balanced_groups,
    balanced_index_order,
    lpt_equal_count,
)
from mimo_sft.data.reorder.buffer import ReorderingBuffer
from mimo_sft.data.reorder.cost_model import (
    batch_costs,
    make_cost_fn,
    make_patch_count_fn,
    patch_counts,
    sample_cost,
    weighted_costs,
)
from mimo_sft.data.reorder.exchange import exchange_window, reorder_local
from mimo_sft.data.reorder.load_bounds import load_spread, lower_bound_max_load, optimal_max_load, rank_loads
from mimo_sft.data.reorder.routing import plan_exchange
from mimo_sft.data.reorder.serialize import (
    deserialize_records,
    merge_samples,
    permute_batch,
    record_meta,
    record_nbytes,
    serialize_records,
    split_samples,
)
from mimo_sft.data.reorder.window_plan import window_orders, window_plan_info, window_routes

__all__ = [
    "assignment_from_order",
    "ReorderingBuffer",
    "balanced_assignment",
    "balanced_groups",
    "balanced_index_order",
    "batch_costs",
    "deserialize_records",
    "exchange_window",
    "load_spread",
    "lower_bound_max_load",
    "lpt_equal_count",
    "make_cost_fn",
    "make_patch_count_fn",
    "merge_samples",
    "optimal_max_load",
    "patch_counts",
    "permute_batch",
    "plan_exchange",
    "rank_loads",
    "record_meta",
    "record_nbytes",
    "reorder_local",
    "sample_cost",
    "serialize_records",
    "split_samples",
    "weighted_costs",
    "window_orders",
    "window_plan_info",
    "window_routes",
]
