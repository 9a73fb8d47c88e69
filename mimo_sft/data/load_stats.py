"""Vision-load statistics of a step: how evenly the micro-batches' image patches spread over the
vision DP ranks, without (``before``) and with (``after``) intra-microbatch reordering.

Per micro-batch the figure is ``max / mean`` of the per-vision-rank patch counts (1.0 = perfectly
even); a step logs the mean over its micro-batches.

* With reordering the ``ReorderingBuffer`` already computed both figures from the costs its
  exchange all-gathers: they are recorded as they come, no collective.
* Without it, each rank records the per-sample patch counts of the micro-batches it read (a local
  computation on ``input_ids``), and at the end of the step the language DP group all-gathers them
  **once** (not once per micro-batch) to lay each micro-batch out in canonical order.

Only the metrics rank logs these figures, so only its language DP group keeps them (``enabled``):
every member of that group records and joins the one all-gather, every other rank records nothing
and joins nothing -- the choice is the same on all members of a group, so no rank waits on a
collective another skips. :func:`vision_load_spread` is the pure arithmetic.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from mimo_sft.data.reorder.load_bounds import load_spread, rank_loads


def vision_load_spread(costs: Sequence[float], n_groups: int, vision_dp: int) -> float | None:
    """``max / mean`` per-vision-rank load of one micro-batch whose per-sample ``costs`` are in canonical
    order (vision DP rank r holds the r-th contiguous part); None when they do not split evenly."""
    if len(costs) % vision_dp:
        return None
    return load_spread(rank_loads(costs, n_groups, vision_dp))["max_over_mean"]


def mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


class VisionLoadStats:
    """One step's vision-load figures on this rank (see the module docstring).

    ``patch_fn(batch)``: per-sample patch counts of a micro-batch. ``group`` / ``group_size``: the
    language DP group that all-gathers the local counts (``group_size`` 1: nothing to gather).
    ``enabled=False``: record nothing, gather nothing (ranks outside the metrics rank's group).
    """

    def __init__(self, *, patch_fn: Callable[[dict], list[float]], n_groups: int, vision_dp: int,
                 group=None, group_size: int = 1, enabled: bool = True, per_gpu: bool = False):
        self.patch_fn = patch_fn
        #: a colocated layout: the plan's per-GPU figures (vision slice + language share) are kept too
        self.per_gpu = per_gpu
        self.n_groups = n_groups
        self.vision_dp = vision_dp
        self.group = group
        self.group_size = group_size
        self.enabled = enabled
        self.start_step()

    def start_step(self) -> None:
        self._local: list[list[float]] = []  # per micro-batch: this rank's per-sample patch counts
        self._before: list[float] = []       # per micro-batch figures handed over by the reorder buffer
        self._after: list[float] = []
        self._gpus: dict[str, list[float]] = {"before": [], "after": []}

    def record(self, batch: dict) -> None:
        """A micro-batch read without reordering: keep its per-sample patch counts (local)."""
        if self.enabled:
            self._local.append(self.patch_fn(batch))

    def record_reordered(self, stats: dict) -> None:
        """A micro-batch from the reorder buffer: keep the figures it computed (``last_stats``)."""
        if not self.enabled:
            return
        before = stats.get("vision_load_max_over_mean_before")
        after = stats.get("vision_load_max_over_mean_after")
        if before is not None:
            self._before.append(float(before))
        if after is not None:
            self._after.append(float(after))
        if self.per_gpu:
            for when in ("before", "after"):
                value = stats.get(f"cost_max_over_mean_{when}")
                if value is not None:
                    self._gpus[when].append(float(value))

    def gpu_figures(self) -> dict[str, float]:
        """A colocated step's per-GPU load spread, before and after its plan (empty: none recorded):
        ``gpu_load_max_over_mean_before`` / ``_after``, means over the step's micro-batches."""
        return {f"gpu_load_max_over_mean_{when}": v for when in ("before", "after")
                if (v := mean_or_none(self._gpus[when])) is not None}

    def step_figures(self) -> tuple[float | None, float | None]:
        """The step's mean ``(before, after)``; collective over ``group`` when counts were recorded
        locally (every enabled rank calls it once per step, after the step's last micro-batch)."""
        if not self.enabled:
            return None, None
        before = list(self._before)
        if self._local:
            for costs in self._gathered():
                spread = vision_load_spread(costs, self.n_groups, self.vision_dp)
                if spread is not None:
                    before.append(float(spread))
        return mean_or_none(before), mean_or_none(self._after)

    def _gathered(self) -> list[list[float]]:
        """Every micro-batch's per-sample counts over the whole DP group, in canonical order: one
        all-gather of a ``[micro-batches, samples]`` tensor for the whole step."""
        local = torch.tensor(self._local, dtype=torch.float64)
        if self.group_size > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(local) for _ in range(self.group_size)]
            dist.all_gather(parts, local, group=self.group)
            local = torch.cat(parts, dim=1)
        return local.tolist()
