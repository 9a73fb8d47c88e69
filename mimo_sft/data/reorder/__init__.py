"""Intra-microbatch reordering: balance per-sample vision load across a module's DP ranks.

Pure planning (:mod:`.planning`: costs, orders, statistics; :mod:`.routing`: where every sample goes) and
byte packing (:mod:`.serialize`) import no collectives; :mod:`.exchange` only moves bytes: the one
all-gather + one ragged all-to-all per window; :mod:`.buffer` wraps the data iterator (optionally
overlapping the next window's exchange on a background thread).
"""

from mimo_sft.data.reorder.buffer import ReorderingBuffer
from mimo_sft.data.reorder.exchange import exchange_window, reorder_local
from mimo_sft.data.reorder.planning import (
    assignment_from_order,
    balanced_assignment,
    balanced_groups,
    balanced_index_order,
    batch_costs,
    load_spread,
    lower_bound_max_load,
    lpt_equal_count,
    make_cost_fn,
    make_patch_count_fn,
    optimal_max_load,
    patch_counts,
    rank_loads,
    sample_cost,
    weighted_costs,
    window_orders,
    window_plan_info,
    window_routes,
)
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
