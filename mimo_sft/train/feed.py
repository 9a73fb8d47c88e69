"""This rank's stream of micro-batches, and the per-step numbers the loop needs from it.

``Feed`` sits between the data layer and megatron's schedule (which calls ``next()`` once per
micro-batch). It

* reads this rank's canonical-grid shard (``mimo_sft.data``), with pixels only where an encoder
  runs;
* on non-colocated layouts with ``--intra-microbatch-reorder``, wraps it in the
  ``ReorderingBuffer`` (one balanced assignment per window, same on every module);
* on colocated layouts, reads the shard of the module with the smaller DP size and cuts it into
  this rank's language part and its encoder part (DP sizes divide one another, so one contains the
  other); megatron's ColocatedBridgeCommunicator then moves encoder output between the two;
* counts, per step, the supervised tokens (for the per-token gradient scale), real tokens and
  samples, the vision-load spread before/after reordering, and the model FLOPs this rank's share of
  the work represents (each sample's language and vision work counted on exactly one rank, so a sum
  over all ranks is the step's model FLOPs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mimo_sft.data.reorder import ReorderingBuffer, load_spread, make_cost_fn, make_patch_count_fn, rank_loads
from mimo_sft.data.reorder.serialize import merge_samples, split_samples
from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import LANGUAGE
from mimo_sft.train.flops import training_flops

PIXEL_KEYS = ("pixel_values", "image_grid_thw")


@dataclass
class StepCounters:
    loss_tokens: float = 0.0
    real_tokens: float = 0.0
    samples: int = 0
    load_before: list = field(default_factory=list)
    load_after: list = field(default_factory=list)
    exchange_s: float = 0.0
    data_wait_s: float = 0.0
    model_flops: float = 0.0


class Feed:
    """Iterator handed to megatron's schedule; see the module docstring."""

    def __init__(self, source, *, layout, pstate, reorder_cfg, model_info, colocated_slices=None):
        self.layout = layout
        self.pstate = pstate
        self.mine = pstate.mine()
        self.colocated_slices = colocated_slices
        self.image_token_id = model_info.image_token_id
        self.merge = model_info.spatial_merge_size
        self.patch_fn = make_patch_count_fn(image_token_id=self.image_token_id, merge_size=self.merge)
        self.encoder_dp = {s.name: s.dp for s in layout.encoders}
        self.vision_dp = layout.encoders[0].dp if layout.encoders else 1
        self.stats_module = LANGUAGE if LANGUAGE in self.mine else self.mine[0]
        spec = layout.spec(self.stats_module)
        self.dp_size = spec.dp
        self.dp_rank = layout.coords(pstate.rank)[self.stats_module].dp
        self.hf_config, self.padded_vocab = model_info.hf_config, model_info.padded_vocab_size
        coords = layout.coords(pstate.rank)
        lang = coords.get(LANGUAGE)
        # count each sample's work once: language on tp/cp/pp rank 0 of its DP rank, vision on encoder tp rank 0
        self.count_language = lang is not None and lang.tp == 0 and lang.cp == 0 and lang.pp == 0
        self.count_vision = any(coords.get(s.name) is not None and coords[s.name].tp == 0 for s in layout.encoders)
        self.reorder = None
        src = iter(source)
        if reorder_cfg.enabled and not layout.colocated:
            mg = pstate.modules[self.stats_module]
            cost_fn = make_cost_fn(encoder_cost_weight=reorder_cfg.encoder_cost_weight,
                                   language_cost_weight=reorder_cfg.language_cost_weight,
                                   image_token_id=self.image_token_id, merge_size=self.merge)
            self.reorder = ReorderingBuffer(
                src, dp_rank=self.dp_rank, dp_size=self.dp_size, n_groups=layout.canonical_grid, cost_fn=cost_fn,
                group=mg.dp_gloo, side_group=mg.reorder_side_gloo,
                overlap=reorder_cfg.overlap, window_size=reorder_cfg.window_size, load_fn=self.patch_fn,
                stats_dp_sizes={"vision": self.vision_dp})
            src = self.reorder
        self._src = src
        self.counters = StepCounters()

    # ---- schedule side ----------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        batch = next(self._src)
        self.counters.data_wait_s += time.perf_counter() - t0
        if self.reorder is not None:
            st = self.reorder.last_stats
            self._record_load(st.get("vision_load_max_over_mean_before"), st.get("vision_load_max_over_mean_after"))
            self.counters.exchange_s += float(st.get("reorder_exchange_s", 0.0))
        else:
            self._record_load(self._gathered_vision_load(batch), None)
        if self.colocated_slices is not None:
            batch = self._colocated_split(batch)
        self._count_flops(batch)
        self.counters.loss_tokens += float(batch["loss_mask"].sum())
        self.counters.real_tokens += float(batch["attention_mask"].sum())
        self.counters.samples += int(batch["input_ids"].shape[0])
        return batch

    def _count_flops(self, batch) -> None:
        """Model FLOPs (forward + backward) of the work this rank counts; padded positions are computed."""
        if not (self.count_language or self.count_vision) or self.hf_config is None:
            return
        ids = batch["input_ids"]
        grids = batch.get("image_grid_thw") if self.count_vision else None
        f = training_flops(self.hf_config, [ids.shape[1]] * ids.shape[0] if self.count_language else [],
                           grids.tolist() if grids is not None and grids.numel() else None, vocab_size=self.padded_vocab)
        self.counters.model_flops += f.total

    def _record_load(self, before, after):
        if before is not None:
            self.counters.load_before.append(float(before))
        if after is not None:
            self.counters.load_after.append(float(after))

    def _gathered_vision_load(self, batch) -> float | None:
        """Max/mean of per-vision-rank patches for this micro-batch without reordering.

        Computed on language ranks only (they log the metrics); encoder ranks skip the all-gather.
        """
        if not self.layout.encoders or self.stats_module != LANGUAGE:
            return None
        local = torch.tensor(self.patch_fn(batch), dtype=torch.float64)
        group = self.pstate.modules[self.stats_module].dp_gloo
        if self.dp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.dp_size)]
            dist.all_gather(parts, local, group=group)
            local = torch.cat(parts)
        costs = local.tolist()
        n_groups = self.layout.canonical_grid
        if len(costs) % self.vision_dp:
            return None
        return load_spread(rank_loads(costs, n_groups, self.vision_dp))["max_over_mean"]

    def _colocated_split(self, batch: dict) -> dict:
        """Language fields for the language DP rank's slice; pixels for the encoder DP rank's slice."""
        lang_sl, enc_sl = self.colocated_slices
        records = split_samples(batch)
        lang = merge_samples([{k: v for k, v in r.items() if k not in PIXEL_KEYS} for r in records[lang_sl]])
        enc = merge_samples([{k: v for k, v in r.items() if k in PIXEL_KEYS} for r in records[enc_sl]])
        if self.encoder_dp and len(set(self.encoder_dp.values()) | {self.layout.language.dp}) > 1:
            # megatron's ColocatedBridgeCommunicator splits and gathers encoder output in equal
            # parts per sample: every sample of the global micro-batch needs the same image-token
            # count. Checked across all ranks (one tiny all-reduce), so no rank hangs in the bridge.
            counts = (batch["input_ids"] == self.image_token_id).sum(dim=1)
            span = torch.tensor([-int(counts.min()), int(counts.max())], dtype=torch.int64)
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=self.pstate.world_gloo)
            low, high = -int(span[0]), int(span[1])
            if low != high:
                raise UserError(
                    "colocated layout with different encoder and language DP sizes needs the same number of "
                    f"image tokens in every sample, but this micro-batch has {low} to {high}: use fixed-size "
                    "single-image data (--min-pixels equal to --max-pixels), or equal DP sizes")
        lang["pixel_values"] = enc.get("pixel_values")
        lang["image_grid_thw"] = enc.get("image_grid_thw")
        return lang

    # ---- loop side ------------------------------------------------------------------------------
    def start_step(self) -> None:
        self.counters = StepCounters()

    def step_loss_tokens(self) -> float:
        return self.counters.loss_tokens

    def close(self) -> None:
        if self.reorder is not None:
            self.reorder.shutdown()


def colocated_read_plan(layout, rank: int, micro_batch_size: int):
    """(module whose shard to read, its dp rank, language slice, encoder slice) on a colocated rank."""
    coords = layout.coords(rank)
    coarse = min(layout.components, key=lambda s: (s.dp, s.name != LANGUAGE))
    shard = micro_batch_size // coarse.dp
    start = coords[coarse.name].dp * shard

    def local(module):
        n = micro_batch_size // layout.spec(module).dp
        lo = coords[module].dp * n - start
        assert 0 <= lo and lo + n <= shard, "DP sizes must divide one another"
        return slice(lo, lo + n)

    enc = layout.encoders[0].name
    return coarse.name, coords[coarse.name].dp, coarse.dp, local(LANGUAGE), local(enc)
