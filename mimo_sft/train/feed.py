"""This rank's stream of micro-batches, as megatron's schedule pulls it (``next()`` per micro-batch).

``Feed`` only feeds: it pulls from the source the data layer built for this rank (its canonical-grid
shard, wrapped in the ``ReorderingBuffer`` when reordering), cuts colocated shards with the data
layer's ``ColocatedSplit``, hands each micro-batch to the step's observers (vision-load statistics
on what was read, model-FLOPs counting on what is fed), and counts what the loop needs per step:
supervised tokens (for the per-token gradient scale), real tokens, samples, and the time spent
waiting for data and in the reorder exchange. It satisfies ``train.step.StepFeed``.

Which source, split and observers a rank gets is decided by :func:`build_feed`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from mimo_sft.data.colocated import ColocatedSplit, colocated_read_plan
from mimo_sft.data.load_stats import VisionLoadStats
from mimo_sft.data.reorder import ReorderingBuffer, make_cost_fn, make_patch_count_fn
from mimo_sft.parallel.layout import LANGUAGE
from mimo_sft.train.metrics import ModelFlopsCounter
from mimo_sft.train.packing import computed_positions


@dataclass
class StepCounters:
    """What this rank fed during one step."""

    loss_tokens: float = 0.0   # supervised tokens (sum of loss_mask)
    real_tokens: float = 0.0   # non-padding tokens (sum of attention_mask)
    samples: int = 0
    computed_positions: float = 0.0  # language positions the model computes (padded, or real when packed)
    exchange_s: float = 0.0    # reorder exchange time the buffer reported (its own wall time, maybe off the critical path)
    reorder_wait_s: float = 0.0  # time the training loop was blocked on the reorder exchange
    data_wait_s: float = 0.0   # time blocked in the source's next()


class Feed:
    """Iterator handed to megatron's schedule; see the module docstring."""

    def __init__(self, source: Iterator[dict], *, reorder: Optional[ReorderingBuffer] = None,
                 split: Optional[Callable[[dict], dict]] = None, load_stats: Optional[VisionLoadStats] = None,
                 flops: Optional[ModelFlopsCounter] = None, packed: bool = False):
        self._src = reorder if reorder is not None else iter(source)
        self.reorder = reorder
        self.split = split
        self.load_stats = load_stats
        self.flops = flops
        self.packed = packed  # --in-batch-packing: the language model computes real tokens only
        self.counters = StepCounters()

    # ---- schedule side ----------------------------------------------------------------------
    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        batch = next(self._src)
        self.counters.data_wait_s += time.perf_counter() - t0
        if self.reorder is not None:
            stats = self.reorder.last_stats
            self.counters.exchange_s += float(stats.get("reorder_exchange_s", 0.0))
            self.counters.reorder_wait_s += float(stats.get("reorder_wait_s", 0.0))
            if self.load_stats is not None:
                self.load_stats.record_reordered(stats)
        elif self.load_stats is not None:
            self.load_stats.record(batch)
        if self.split is not None:
            batch = self.split(batch)
        if self.flops is not None:
            self.flops.count(batch)
        self.counters.loss_tokens += float(batch["loss_mask"].sum())
        self.counters.real_tokens += float(batch["attention_mask"].sum())
        self.counters.computed_positions += computed_positions(batch, packed=self.packed)
        self.counters.samples += int(batch["input_ids"].shape[0])
        return batch

    # ---- loop side ------------------------------------------------------------------------------
    def start_step(self) -> None:
        self.counters = StepCounters()
        if self.load_stats is not None:
            self.load_stats.start_step()
        if self.flops is not None:
            self.flops.start_step()

    def step_loss_tokens(self) -> float:
        return self.counters.loss_tokens

    def close(self) -> None:
        if self.reorder is not None:
            self.reorder.shutdown()


def build_feed(cfg, layout, pstate, info, *, consumed_samples: int, train_source=None) -> Feed:
    """This rank's feed: which shard it reads (module, DP coordinates, pixels or not), reordering,
    the colocated split, and the step observers (vision load where it is logged, model FLOPs).
    ``train_source``: the training rows when a validation split was held out of them."""
    from mimo_sft.data.loader import build_microbatch_iterator

    rank = pstate.rank
    mbs = cfg.train.micro_batch_size
    common = dict(model_dir=cfg.model.hf_model, micro_batch_size=mbs, canonical_grid=layout.canonical_grid,
                  seed=cfg.train.seed, consumed_samples=consumed_samples, scalable_dp=cfg.parallel.scalable_dp,
                  global_batch_size=cfg.train.global_batch_size)
    load_stats = _vision_load_stats(layout, pstate, info)
    packed = cfg.data.in_batch_packing
    flops = ModelFlopsCounter.for_rank(layout, rank, info, packed=packed)
    shard = read_shard(layout, pstate, info, mbs)
    source = build_microbatch_iterator(cfg.data, dp_size=shard.dp_size, dp_rank=shard.dp_rank,
                                       need_pixels=shard.need_pixels, source=train_source, **common)
    if layout.colocated:
        return Feed(source, split=shard.split, load_stats=load_stats, flops=flops, packed=packed)
    module, coord = shard.module, layout.coords(rank)[shard.module]
    reorder = None
    r = cfg.reorder
    if r.enabled:
        groups = pstate.modules[module]
        cost_fn = make_cost_fn(encoder_cost_weight=r.encoder_cost_weight, language_cost_weight=r.language_cost_weight,
                               image_token_id=info.image_token_id, merge_size=info.spatial_merge_size)
        reorder = ReorderingBuffer(
            iter(source), dp_rank=coord.dp, dp_size=layout.spec(module).dp, n_groups=layout.canonical_grid,
            cost_fn=cost_fn, group=groups.dp_gloo, side_group=groups.reorder_side_gloo, overlap=r.overlap,
            window_size=r.window_size, load_fn=_patch_fn(info),
            stats_dp_sizes={"vision": layout.encoders[0].dp if layout.encoders else 1})
    return Feed(source, reorder=reorder, load_stats=load_stats, flops=flops, packed=packed)


@dataclass(frozen=True)
class ReadShard:
    """Which canonical-grid shard of each micro-batch this rank reads (training and validation alike)."""

    dp_size: int
    dp_rank: int
    need_pixels: bool
    module: Optional[str]  # non-colocated: the one module of this rank
    split: Optional[ColocatedSplit]  # colocated: the language slice plus the encoder slice's pixels


def read_shard(layout, pstate, info, micro_batch_size: int) -> ReadShard:
    """Colocated ranks read the shard of the module with the smaller DP size and split it
    (``data.colocated``); a non-colocated rank reads its module's shard, pixels on encoder ranks."""
    if layout.colocated:
        plan = colocated_read_plan(layout, pstate.rank, micro_batch_size)
        split = ColocatedSplit.for_plan(plan, layout, image_token_id=info.image_token_id)
        return ReadShard(plan.dp_size, plan.dp_rank, True, None, split)
    (module,) = pstate.mine()
    coord = layout.coords(pstate.rank)[module]
    return ReadShard(layout.spec(module).dp, coord.dp, module != LANGUAGE, module, None)


def _patch_fn(info):
    return make_patch_count_fn(image_token_id=info.image_token_id, merge_size=info.spatial_merge_size)


def _vision_load_stats(layout, pstate, info) -> Optional[VisionLoadStats]:
    """Vision-load statistics where they are logged: the metrics rank's language DP group (language
    tp 0, cp 0, last pipeline stage; every member of it, since they gather together), else None."""
    c = layout.coords(pstate.rank).get(LANGUAGE)
    if not layout.encoders or c is None:
        return None
    spec = layout.language
    enabled = c.tp == 0 and c.cp == 0 and c.pp == spec.pp - 1
    return VisionLoadStats(patch_fn=_patch_fn(info), n_groups=layout.canonical_grid, vision_dp=layout.encoders[0].dp,
                           group=pstate.modules[LANGUAGE].dp_gloo, group_size=spec.dp, enabled=enabled)
