"""Reordering by index (``--reorder-mode index``): balance a micro-batch without moving a pixel.

The exchange (``data.reorder.exchange``) has every rank read its canonical shard, decode it, then
all-gather the costs and ship the samples the balanced plan moves (51-69 % of them at DP 4-16, as
fp32 patches). Here every rank instead reads the *cheap* part of the whole global micro-batch --
the text path, driven by image headers, exactly what language-only ranks already compute -- and
runs the same planner on the same costs (:func:`window_plan.window_plan_info`, the one place that
decides a layout). Every rank therefore knows the whole assignment without talking, and then
decodes the pixels of only the samples it owns, in canonical order. No byte crosses ranks, no
thread, no process group.

Exactness: the costs are the exchange's ``cost_fn`` applied to the same per-sample fields (a row's
cost does not depend on the other rows), the planner is the same function, and this rank's
micro-batch is the collate of its samples in canonical order -- what the exchange's merge of the
same records gives. So the same samples land on the same ranks, and losses and gradients are the
exchange mode's bit for bit (``tests/test_reorder_index.py``).

Each DataLoader item is one global micro-batch; the work runs in the DataLoader workers, ahead of
time like any other micro-batch.
"""

from __future__ import annotations

from typing import Callable, Mapping

from mimo_sft.data.microbatch import ERROR_KEY, STATS_KEY, MicroBatchDataset
from mimo_sft.data.reorder import window_plan
from mimo_sft.errors import BadSampleError, UserError

_PLAN_ONLY = ("order", "global_costs")  # plan internals the feed does not log


class IndexReorderedDataset(MicroBatchDataset):
    """Item = the indices of one whole global micro-batch -> this rank's balanced share of it.

    ``cost_fn`` / ``load_fn`` / ``n_groups`` / ``stats_dp_sizes`` are the ones the exchange would get
    (``train.feed`` builds both modes from the same values).
    """

    def __init__(self, source, pre, *, dp_rank: int, dp_size: int, n_groups: int,
                 cost_fn: Callable[[Mapping], list[float]], load_fn: Callable[[Mapping], list[float]] | None = None,
                 stats_dp_sizes: Mapping[str, int] | None = None, **kw):
        super().__init__(source, pre, **kw)
        if n_groups % dp_size:
            raise ValueError(f"DP size {dp_size} does not divide the canonical grid {n_groups}")
        self.dp_rank, self.dp_size, self.n_groups = dp_rank, dp_size, n_groups
        self.cost_fn, self.load_fn = cost_fn, load_fn
        self.stats_dp_sizes = dict(stats_dp_sizes or {})

    def plan(self, texts: list[dict]) -> dict:
        """The exchange's plan for this micro-batch, from the text path of all its samples."""
        fields = self.collate(texts, need_pixels=False)
        costs = [float(c) for c in self.cost_fn(fields)]
        loads = [float(c) for c in self.load_fn(fields)] if self.load_fn else costs
        return window_plan.window_plan_info([costs], [loads], n_groups=self.n_groups, dp_size=self.dp_size,
                                            stats_dp_sizes=self.stats_dp_sizes)[0]

    def add_pixels(self, sample: dict) -> dict:
        """Decode the images of one (owned) sample; a text-only stand-in has none to decode."""
        if not sample["grids"] or "pixel_values" in sample:
            return sample
        sid = sample["sample_id"]
        _messages, refs = self.source[sid]
        try:
            sample["pixel_values"], sample["image_grid_thw"] = self.pre.pixels(self.pre.image_specs(refs, sid), sid)
        except BadSampleError as err:  # same stand-in as the exchange mode's (MicroBatchDataset.encode)
            if self.max_bad_samples <= 0:
                raise
            self._bad.append((sid, err.path, err.reason, "pixels"))
            sample["pixel_values"], sample["image_grid_thw"] = self.pre.blank_pixels(sample["grids"])
            sample["blank_images"] = len(sample["grids"])
        return sample

    def __getitem__(self, indices) -> dict:
        self._bad = []
        try:
            texts = [self.encode(i, need_pixels=False) for i in indices]
            info = self.plan(texts)
            per = len(texts) // self.dp_size
            mine = [texts[k] for k in info["order"][self.dp_rank * per: (self.dp_rank + 1) * per]]
            owned = {s["sample_id"] for s in mine}
            self._bad = [b for b in self._bad if b[0] in owned]  # every rank read them; count each once
            if self.need_pixels:
                mine = [self.add_pixels(s) for s in mine]
        except UserError as err:  # crosses worker processes as data, re-raised as one line
            return {ERROR_KEY: str(err)}
        batch = self.collate(mine, self.need_pixels)
        stats = {k: v for k, v in info.items() if k not in _PLAN_ONLY}
        stats.update(order=info["order"], reorder_exchange_s=0.0, reorder_wait_s=0.0, reorder_bytes=0)
        batch[STATS_KEY] = stats
        return batch
