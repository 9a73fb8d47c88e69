"""What reordering does to each rank's load, computed from per-sample numbers alone (pure).

Why a separate, pure module: the planner's figures are only worth something if they are the
numbers training would log. So this module owns no rule of its own; it calls the functions the
exchange calls, on the same per-sample numbers the cost function reads from ``input_ids`` /
``attention_mask``:

* vision load of a sample = its image patches (= image placeholder tokens * merge**2, what
  ``cost_model.patch_counts`` counts in ``input_ids``);
* language load of a sample = its real tokens after truncation (= ``attention_mask.sum()``);
* cost = ``cost_model.weighted_costs`` of those two, the one formula ``cost_model.batch_costs`` applies
  in training;
* order of each micro-batch = ``window_plan.window_orders``, window by window, what
  ``window_plan.window_plan_info`` (the exchange's and the DP-1 path's plan) lays out;
* per-rank loads before/after = ``load_bounds.loads_before_after``, as ``window_plan_info`` logs them.

No torch.distributed, no processes: the inputs are plain lists, so this is unit-testable and fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mimo_sft.data.reorder import colocated_plan, cost_model, load_bounds, window_plan

IMAGES, LANGUAGE = "images", "language"
#: colocated layouts: the per-GPU load (its vision slice plus its share of its language DP rank,
#: ``colocated_plan.group_loads``), one value per canonical group
GPUS = "gpus"


@dataclass
class MicroBatchLoad:
    """One global micro-batch in canonical (sampler) order: per-sample ids and loads."""

    sample_ids: list[int]
    patches: list[float]
    tokens: list[float]
    images: list[int] = field(default_factory=list)  # images per sample (for the exchange's byte count)


@dataclass
class ModuleTrace:
    """Per-micro-batch per-rank loads of one module, before and after reordering."""

    dp: int
    before: list[list[float]] = field(default_factory=list)
    after: list[list[float]] = field(default_factory=list)
    #: each micro-batch's balanced order (the layout "after" reads), shared by every module's trace
    orders: list[list[int]] = field(default_factory=list)


def costs_of(mb: MicroBatchLoad, encoder_cost_weight: float, language_cost_weight: float) -> list[float]:
    """The reorder cost of every sample: ``cost_model.weighted_costs``, training's formula, on these counts."""
    return cost_model.weighted_costs(mb.patches, mb.tokens, encoder_cost_weight=encoder_cost_weight,
                                     language_cost_weight=language_cost_weight)


def check_weights(encoder_cost_weight: float, language_cost_weight: float) -> None:
    """Refuse the weights the training loop's ``cost_model.make_cost_fn`` refuses, as it refuses them.

    The ids are placeholders: only the weights are checked here.
    """
    cost_model.make_cost_fn(encoder_cost_weight=encoder_cost_weight, language_cost_weight=language_cost_weight,
                            image_token_id=0, merge_size=1)


def orders_for(micro_batches: Sequence[MicroBatchLoad], *, n_groups: int, encoder_cost_weight: float,
               language_cost_weight: float, window_size: int) -> list[list[int]]:
    """The balanced order of every micro-batch, computed window by window as the buffer does.

    ``window_plan.window_orders`` is what ``window_plan.window_plan_info`` lays every window out with (the
    exchange at any DP size and the DP-1 permutation alike): one global order per slot, of which a
    module of any DP size that divides the grid reads its rank's slice. Going window by window (not
    micro-batch by micro-batch) keeps the planner honest if windows ever start balancing across slots.
    """
    check_weights(encoder_cost_weight, language_cost_weight)
    if window_size < 1:
        raise ValueError(f"window size must be >= 1, got {window_size}")
    orders: list[list[int]] = []
    for start in range(0, len(micro_batches), window_size):
        window = micro_batches[start:start + window_size]
        wcosts = [costs_of(mb, encoder_cost_weight, language_cost_weight) for mb in window]
        orders.extend(window_plan.window_orders(wcosts, n_groups))
    return orders


def trace(micro_batches: Sequence[MicroBatchLoad], *, n_groups: int, dp_sizes: dict[str, int],
          encoder_cost_weight: float, language_cost_weight: float, window_size: int,
          colocated=None) -> dict[str, ModuleTrace]:
    """Per-rank loads of ``images`` (patches) and ``language`` (tokens), before and after.

    ``colocated`` (a ``colocated_plan.ColocatedGrid``): the orders are the per-GPU plan's
    (``colocated_plan_info``, what index mode lays out there) and a :data:`GPUS` trace is added.
    """
    if colocated is None:
        orders = orders_for(micro_batches, n_groups=n_groups, encoder_cost_weight=encoder_cost_weight,
                            language_cost_weight=language_cost_weight, window_size=window_size)
    else:
        check_weights(encoder_cost_weight, language_cost_weight)
        infos = [colocated_plan.colocated_plan_info(mb.tokens, mb.patches, grid=colocated,
                                                    encoder_cost_weight=encoder_cost_weight,
                                                    language_cost_weight=language_cost_weight)
                 for mb in micro_batches]
        orders = [info["order"] for info in infos]
    out = {name: ModuleTrace(dp, orders=orders) for name, dp in dp_sizes.items()}
    if colocated is not None:
        out[GPUS] = ModuleTrace(colocated.n_groups, orders=orders, before=[i["cost_before"] for i in infos],
                                after=[i["cost_after"] for i in infos])
    for mb, order in zip(micro_batches, orders):
        for name, tr in out.items():
            if name == GPUS:
                continue
            loads = mb.patches if name == IMAGES else mb.tokens
            before, after = load_bounds.loads_before_after(loads, order, n_groups, tr.dp)
            tr.before.append(before)
            tr.after.append(after)
    return out


#: The tail the report shows next to each mean ("p95"): a micro-batch this bad happens every ~20.
TAIL_QUANTILE = 0.95


def _p95(values: Sequence[float]) -> float:
    """95th percentile, linear interpolation (numpy's default), without importing numpy."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = TAIL_QUANTILE * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def wait_share(loads: Sequence[float]) -> float:
    """Share of a synchronous step the average rank spends waiting for the heaviest: 1 - mean/max."""
    top = max(loads)
    return 1.0 - (sum(loads) / len(loads)) / top if top > 0 else 0.0


def per_micro_batch(tr: ModuleTrace) -> dict[str, list[float]]:
    """Per-micro-batch series: heaviest/lightest/mean rank, max/mean, spread, waiting share."""
    out: dict[str, list[float]] = {}
    for when, rows in (("before", tr.before), ("after", tr.after)):
        spreads = [load_bounds.load_spread(r) for r in rows]
        out[f"max_{when}"] = [s["max"] for s in spreads]
        out[f"min_{when}"] = [min(r) for r in rows]
        out[f"max_over_mean_{when}"] = [s["max_over_mean"] for s in spreads]
        out[f"spread_{when}"] = [s["max_minus_min"] for s in spreads]
        out[f"wait_share_{when}"] = [wait_share(r) for r in rows]
    out["mean"] = [load_bounds.load_spread(r)["mean"] for r in tr.before]
    return out


def summarize(tr: ModuleTrace) -> dict[str, float]:
    """Mean and p95 over micro-batches of max/mean and spread; mean waiting share."""
    series = per_micro_batch(tr)
    out: dict[str, float] = {"dp": tr.dp, "mean_load": _mean(series["mean"])}
    for when in ("before", "after"):
        out[f"max_over_mean_{when}"] = _mean(series[f"max_over_mean_{when}"])
        out[f"max_over_mean_p95_{when}"] = _p95(series[f"max_over_mean_{when}"])
        out[f"spread_{when}"] = _mean(series[f"spread_{when}"])
        out[f"spread_p95_{when}"] = _p95(series[f"spread_{when}"])
        out[f"wait_share_{when}"] = _mean(series[f"wait_share_{when}"])
    return out


def training_steps(tr: ModuleTrace, micro_batches_per_step: int) -> list[dict[str, float]]:
    """What ``metrics.jsonl`` logs per optimizer step for this module's load.

    The loop logs ``vision_load_max_over_mean_before/_after`` = mean over the step's micro-batches
    of (heaviest rank / mean), with ``load_spread``'s convention of 1.0 for an empty micro-batch.
    Only whole steps are returned.
    """
    series = per_micro_batch(tr)
    steps = []
    for s in range(len(tr.before) // micro_batches_per_step):
        sl = slice(s * micro_batches_per_step, (s + 1) * micro_batches_per_step)
        steps.append({"step": s + 1,
                      "max_over_mean_before": _mean(series["max_over_mean_before"][sl]),
                      "max_over_mean_after": _mean(series["max_over_mean_after"][sl])})
    return steps


def exchange_bytes(micro_batches: Sequence[MicroBatchLoad], orders: Sequence[Sequence[int]], *,
                   dp_sizes: dict[str, int], seq_length: int, patch_bytes: int) -> list[float]:
    """Bytes ``--reorder-mode exchange`` sends between ranks per micro-batch (all modules; 0 by
    index). A sample moves when the balanced order puts it on another DP rank than the one that read
    it; its size is ``serialize.record_nbytes`` of the record training builds (the design.md fields,
    padded to ``seq_length``; on encoder ranks also its uint8 patches and grid rows)."""
    from mimo_sft.data.reorder.serialize import record_nbytes

    def nbytes(patches: float, images: int, pixels: bool) -> int:
        s = seq_length
        meta = [("answer_cut", "bool", (1,)), ("answer_empty", "bool", (1,)),
                ("attention_mask", "bool", (1, s)), ("image_counts", "i64", (1,)), ("input_ids", "i64", (1, s)),
                ("labels", "i64", (1, s)), ("loss_mask", "f32", (1, s)), ("mm_token_type_ids", "i64", (1, s)),
                ("position_ids", "i64", (3, 1, s)), ("sample_ids", "i64", (1,))]
        if pixels:
            meta += [("image_grid_thw", "i64", (images, 3)), ("pixel_values", "u8", (int(patches), patch_bytes))]
        return record_nbytes(tuple(sorted(meta)))

    out = []
    for mb, order in zip(micro_batches, orders):
        n, total = len(order), 0
        images = mb.images or [0] * n
        for name, dp in dp_sizes.items():
            per = n // dp
            for k, i in enumerate(order):
                if k // per != i // per:  # read by rank i // per, owned by rank k // per
                    total += nbytes(mb.patches[i], images[i], name != "language")
        out.append(float(total))
    return out
