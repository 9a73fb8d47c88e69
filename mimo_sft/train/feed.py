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
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from mimo_sft.data.colocated import ColocatedSplit, colocated_read_plan
from mimo_sft.data.load_stats import VisionLoadStats
from mimo_sft.data.mixture import MixtureSource
from mimo_sft.data.reorder import ReorderingBuffer, make_cost_fn, make_patch_count_fn
from mimo_sft.parallel.layout import LANGUAGE
from mimo_sft.train.metrics import ModelFlopsCounter
from mimo_sft.train.packing import computed_positions
from mimo_sft.train.profile import phase


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
    truncated_samples: int = 0  # samples whose supervised answer was cut at --seq-length
    empty_answers: int = 0      # samples with an assistant turn that has no text
    first_truncated: int = -1   # smallest dataset index of each kind seen this step (-1: none)
    first_empty: int = -1
    reorder_bytes: float = 0.0  # sample bytes this rank's reorder exchange sent to other ranks (0 by index)
    images_decoded: int = 0    # images this rank decoded (its DataLoader workers) for this step's micro-batches
    video_frames_decoded: int = 0  # clip frames this rank's workers decoded for them
    video_decode_s: float = 0.0    # worker time spent decoding and cutting those clips
    vision_patches: float = 0.0  # patches this rank's encoder slice held (0 without an encoder): cost calibration
    language_share: float = 0.0  # real tokens of its language slice / (language tp x cp): its share of that work
    source_samples: list = field(default_factory=list)  # a mixture: samples fed per source


class Feed:
    """Iterator handed to megatron's schedule; see the module docstring."""

    def __init__(self, source: Iterator[dict], *, reorder=None,
                 split: Optional[Callable[[dict], dict]] = None, load_stats: Optional[VisionLoadStats] = None,
                 flops: Optional[ModelFlopsCounter] = None, packed: bool = False):
        # reorder: the ReorderingBuffer (exchange mode), or the source itself (index mode: the
        # DataLoader's items carry the plan's figures in ``last_stats``)
        self._src = reorder if reorder is not None else iter(source)
        self.source = source
        self.reorder = reorder
        self._totals = self._data_totals()
        self.split = split
        self.load_stats = load_stats
        self.flops = flops
        self.packed = packed  # --in-batch-packing: the language model computes real tokens only
        self.counters = StepCounters()
        #: the per-rank work figures the straggler report carries for cost calibration (``config.calibration``):
        #: ``patches_of(batch)`` this rank's encoder slice's patches (None: no encoder here), ``token_share``
        #: ``1 / language tp`` on a language rank (0: none)
        self.patches_of: Optional[Callable[[dict], float]] = None
        self.token_share = 0.0
        #: the training data source and what places a stream position in it (``stream_position``), set by build_feed
        self.train_source, self.position_args = None, {}
        self._ahead: Optional[dict] = None  # the micro-batch :meth:`prefetch` took, handed out by the next ``next()``

    @property
    def mixture(self):
        """The training mixture (``data.mixture.MixtureSource``; None: one dataset)."""
        return self.train_source if isinstance(self.train_source, MixtureSource) else None

    def stream_position(self, consumed_samples: int) -> dict:
        """Where each streamed source stands after ``consumed_samples`` (meta.json's ``streams``; empty: none)."""
        from mimo_sft.data.streamed import stream_position

        if self.train_source is None:
            return {}
        return stream_position(self.train_source, consumed_samples, **self.position_args)

    # ---- schedule side ----------------------------------------------------------------------
    def __iter__(self) -> "Feed":
        return self

    def prefetch(self) -> None:
        """Take the first micro-batch from the source now: the trainer counts the wait for it (the loader's workers
        starting, the first images decoded, the first reorder plan) as start-up, not as step 1's data wait. Every
        rank takes it at the same point of its set-up, so the index mode's cost gather stays matched. The next
        ``next()`` hands it out and counts it as it would have; a source with nothing to give is left to that call."""
        assert self._ahead is None, "prefetch takes the first micro-batch only"
        with phase("data wait"):
            self._ahead = next(self._src, None)

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        with phase("data wait"):
            batch, self._ahead = (self._ahead, None) if self._ahead is not None else (next(self._src), None)
        self.counters.data_wait_s += time.perf_counter() - t0
        if self.reorder is not None:
            stats = self.reorder.last_stats
            self.counters.exchange_s += float(stats.get("reorder_exchange_s", 0.0))
            self.counters.reorder_wait_s += float(stats.get("reorder_wait_s", 0.0))
            self.counters.reorder_bytes += float(stats.get("reorder_bytes", 0.0))
            if self.load_stats is not None:
                self.load_stats.record_reordered(stats)
        elif self.load_stats is not None:
            self.load_stats.record(batch)
        if self.split is not None:
            batch = self.split(batch)
        if self.flops is not None:
            self.flops.count(batch)
        self.counters.loss_tokens += float(batch["loss_mask"].sum())
        real = float(batch["attention_mask"].sum())
        self.counters.real_tokens += real
        self.counters.language_share += real * self.token_share
        if self.patches_of is not None:
            self.counters.vision_patches += self.patches_of(batch)
        self.counters.computed_positions += computed_positions(batch, packed=self.packed)
        self.counters.samples += int(batch["input_ids"].shape[0])
        if self.mixture is not None and "source_ids" in batch:
            n = len(self.mixture.names)
            per = batch["source_ids"].bincount(minlength=n).tolist()
            c = self.counters
            c.source_samples = [a + b for a, b in zip(c.source_samples or [0] * n, per)]
        self._count_answers(batch)
        return batch

    def _count_answers(self, batch: dict) -> None:
        """Truncated and empty answers of this rank's samples (language ranks count them once each)."""
        c, ids = self.counters, batch.get("sample_ids")
        for key, count, first in (("answer_cut", "truncated_samples", "first_truncated"),
                                  ("answer_empty", "empty_answers", "first_empty")):
            flags = batch.get(key)
            if flags is None or ids is None or not bool(flags.any()):
                continue
            setattr(c, count, getattr(c, count) + int(flags.sum()))
            lowest = int(ids[flags].min())
            setattr(c, first, lowest if getattr(c, first) < 0 else min(getattr(c, first), lowest))

    # ---- loop side ------------------------------------------------------------------------------
    def _data_totals(self) -> tuple:
        """(images decoded, clip frames decoded, clip decode seconds) so far, from the data iterator's running totals
        (its bad samples are counted over all ranks: ``train.bad_samples``)."""
        it = self.source
        if not hasattr(it, "images_decoded"):
            return 0, 0, 0.0
        return it.images_decoded, it.video_frames_decoded, it.video_decode_s

    def end_step(self) -> StepCounters:
        """The step's counters, with what the data iterator decoded and skipped since the last step.
        Running totals (not per micro-batch): with the overlapped exchange the iterator runs ahead."""
        totals = self._data_totals()
        c, before = self.counters, self._totals
        c.images_decoded, c.video_frames_decoded, c.video_decode_s = (now - was for now, was in zip(totals, before))
        self._totals = totals
        return self.counters

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


def build_feed(cfg, layout, pstate, info, *, consumed_samples: int, train_source=None,
               interleave: str | None = None) -> Feed:
    """This rank's feed (:func:`_build_feed`), knowing its training source (a mixture's sources, streamed ones).
    ``interleave``: a resumed mixture's rule (``data.mixture.resumed_interleave``; None: the current one)."""
    source = train_source if train_source is not None else checked_source(cfg, pstate)
    if interleave is not None and isinstance(source, MixtureSource):
        source.interleave = interleave
    feed = _build_feed(cfg, layout, pstate, info, consumed_samples=consumed_samples, source=source)
    _set_work_figures(feed, layout, pstate.rank, info)
    feed.train_source = source
    feed.position_args = dict(seed=cfg.train.seed, micro_batch_size=cfg.train.micro_batch_size,
                              drop_last=cfg.data.drop_last)
    return feed


def _build_feed(cfg, layout, pstate, info, *, consumed_samples: int, source) -> Feed:
    """This rank's feed: which shard it reads (module, DP coordinates, pixels or not), reordering
    (by index or by exchange), the colocated split, and the step observers (vision load where it is
    logged, model FLOPs). The dataset is opened and its files checked once (:func:`checked_source`);
    ``source``: the (checked) training rows (a held-out split leaves only the training part)."""
    from mimo_sft.data.loader import build_microbatch_iterator
    from mimo_sft.parallel import runtime

    rank = pstate.rank
    mbs = cfg.train.micro_batch_size
    common = dict(model_dir=cfg.model.hf_model, micro_batch_size=mbs, canonical_grid=layout.canonical_grid,
                  seed=cfg.train.seed, consumed_samples=consumed_samples, scalable_dp=cfg.parallel.scalable_dp,
                  global_batch_size=cfg.train.global_batch_size, source=source, pin_memory=runtime.on_gpu())
    load_stats = _vision_load_stats(layout, pstate, info)
    packed = cfg.data.in_batch_packing
    flops = ModelFlopsCounter.for_rank(layout, rank, info, packed=packed)
    coords = layout.coords(rank)
    if layout.colocated:
        plan = colocated_read_plan(layout, rank, mbs)
        index = _colocated_index(cfg, layout, pstate, info, plan.module) if cfg.reorder.enabled else None
        it = build_microbatch_iterator(cfg.data, dp_size=plan.dp_size, dp_rank=plan.dp_rank, need_pixels=True,
                                       pixel_slice=plan.encoder, index_reorder=index, **common)
        split = ColocatedSplit.for_plan(plan, layout, image_token_id=info.image_token_id)
        return Feed(it, reorder=it if index is not None else None, split=split, load_stats=load_stats, flops=flops,
                    packed=packed)
    (module,) = pstate.mine()
    coord = coords[module]
    spec = layout.spec(module)
    r = cfg.reorder
    cost_fn = load_fn = None
    if r.enabled:
        cost_fn = make_cost_fn(encoder_cost_weight=r.encoder_cost_weight, language_cost_weight=r.language_cost_weight,
                               image_token_id=info.image_token_id, merge_size=info.spatial_merge_size)
        load_fn = _patch_fn(info)
    stats_dp = {"vision": layout.encoders[0].dp if layout.encoders else 1}
    index = None
    if r.enabled and r.mode == "index":
        # the shard costs' all-gather runs on the reorder thread's own gloo DP group (data.indexed)
        from mimo_sft.data.cost_file import cost_dir
        from mimo_sft.data.reorder.cost_model import make_count_cost_fn

        count_costs = make_count_cost_fn(encoder_cost_weight=r.encoder_cost_weight,
                                         language_cost_weight=r.language_cost_weight, merge_size=info.spatial_merge_size)
        index = dict(n_groups=layout.canonical_grid, cost_fn=cost_fn, load_fn=load_fn, stats_dp_sizes=stats_dp,
                     cost_folder=cost_dir(cfg.data), count_costs=count_costs,
                     group=pstate.modules[module].reorder_side_gloo)
    it = build_microbatch_iterator(cfg.data, dp_size=spec.dp, dp_rank=coord.dp, need_pixels=module != LANGUAGE,
                                   index_reorder=index, **common)
    if index is not None:
        return Feed(it, reorder=it, load_stats=load_stats, flops=flops, packed=packed)
    reorder = None
    if r.enabled:
        groups = pstate.modules[module]
        reorder = ReorderingBuffer(
            iter(it), dp_rank=coord.dp, dp_size=spec.dp, n_groups=layout.canonical_grid,
            cost_fn=cost_fn, group=groups.dp_gloo, side_group=groups.reorder_side_gloo, overlap=r.overlap,
            window_size=r.window_size, load_fn=load_fn, stats_dp_sizes=stats_dp)
    return Feed(it, reorder=reorder, load_stats=load_stats, flops=flops, packed=packed)


def _colocated_index(cfg, layout, pstate, info, module: str) -> dict:
    """Index-mode reordering on a colocated layout (``data.reorder.colocated_plan``): the ranks of the
    read module's DP group gather each sample's real tokens and patches and lay the micro-batch out so
    that the heaviest GPU -- its vision slice plus its share of its language DP rank -- is as light as
    they can make it; each rank then reads its (coarse) shard of that order and splits it as before."""
    from functools import partial

    from mimo_sft.data.cost_file import cost_dir
    from mimo_sft.data.reorder.colocated_plan import ColocatedGrid, colocated_plan_info
    from mimo_sft.data.reorder.cost_model import make_count_fn, make_real_token_fn

    r = cfg.reorder
    grid = ColocatedGrid.from_layout(layout)
    stats_dp = {"vision": grid.vision_dp}
    plan_fn = partial(colocated_plan_info, grid=grid, encoder_cost_weight=r.encoder_cost_weight,
                      language_cost_weight=r.language_cost_weight, stats_dp_sizes=stats_dp)
    return dict(n_groups=layout.canonical_grid, cost_fn=make_real_token_fn(), load_fn=_patch_fn(info),
                stats_dp_sizes=stats_dp, plan_fn=plan_fn, cost_folder=cost_dir(cfg.data),
                count_costs=make_count_fn(merge_size=info.spatial_merge_size),
                group=pstate.modules[module].reorder_side_gloo)


def checked_source(cfg, pstate, data_cfg=None, *, cache_verdict: bool = True):
    """The dataset (``data_cfg``, default ``cfg.data``), converted once per node, its image files
    checked on rank 0 only (``cache_verdict=False``: not cached in the output folder; ``evaluate``).

    Opening: ``datasets`` converts a parquet/json file into an Arrow file in its cache and
    memory-maps that. The first rank of each node (:func:`first_on_node`) opens the dataset while
    the node's other ranks wait on the start-up group; they then open the same cache, a memory map
    of the same file (one conversion and one copy per node without relying on datasets' cache lock,
    which a network filesystem may not honour). A failure on a node's first rank reaches every rank
    as the same line.
    Checking: rank 0 streams the path column (``data.file_check``; the verdict is cached in the
    run's output folder, so a resumed run skips it), while the other ranks open their memory maps,
    then wait; the group's timeout is ``parallel.groups.STARTUP_WAIT``, not ``--dist-timeout``.
    Every rank then raises the same one-line error, or none. One process (no world group): both
    done here directly.
    """
    import torch.distributed as dist

    from mimo_sft.data.file_check import cached_check
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.errors import UserError

    data_cfg = data_cfg if data_cfg is not None else cfg.data
    group = getattr(pstate, "startup_gloo", None)
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        source = load_sft_dataset(data_cfg, check_files=False)
    else:
        first = first_on_node(group)
        source, failure = None, None
        if first:
            try:
                source = load_sft_dataset(data_cfg, check_files=False)
            except Exception as err:  # noqa: BLE001 - shared with the node's other ranks, raised below
                failure = err
        lines: list = [None] * world  # doubles as the barrier: followers open the dataset after it
        dist.all_gather_object(lines, None if failure is None else (isinstance(failure, UserError), _line(failure)),
                               group=group)
        shared = next((line for line in lines if line is not None), None)
        if failure is not None:
            raise failure
        if shared is not None:
            user, text = shared
            raise UserError(text) if user else RuntimeError(f"a node's first rank could not open the dataset: {text}")
        if not first:
            source = load_sft_dataset(data_cfg, check_files=False)
    cache = cfg.logging.output_dir if cache_verdict else None
    verdict = [_file_verdict(source, cache, cached_check) if pstate.rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(verdict, src=0, group=group)
    if verdict[0] is not None:
        raise UserError(verdict[0])
    return source


def _file_verdict(source, cache, cached_check):
    """The image-file check's verdict; a mixture's sources each checked (and cached) on their own,
    a failure naming its source."""
    parts = getattr(source, "parts", None)
    if parts is None:
        return cached_check(source, cache)
    for name, part in zip(source.names, parts):
        verdict = cached_check(part, cache)
        if verdict is not None:
            return f"source '{name}': {verdict}"
    return None


def first_on_node(group) -> bool:
    """Whether this rank is the lowest rank of ``group`` on its host (torchrun's local rank 0 under its
    usual rank order; the rank that writes the node's Arrow cache). Collective over ``group``."""
    import socket

    import torch.distributed as dist

    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    me = dist.get_rank(group)
    return hosts.index(hosts[me]) == me


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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


def _set_work_figures(feed: Feed, layout, rank: int, info) -> None:
    """What this rank books as its work per step for the cost calibration: the patches of the encoder slice it
    encodes (a colocated batch names them in ``encoder_image_tokens`` when the DP sizes differ; else its own
    ``input_ids``), and its language slice's real tokens over the language tp it shares them with."""
    coords = layout.coords(rank)
    if coords.get(LANGUAGE) is not None:
        feed.token_share = 1.0 / (layout.language.tp * layout.language.cp)  # cp ranks split the positions too
    if any(coords.get(s.name) is not None for s in layout.encoders):
        count, per_token = _patch_fn(info), float(info.spatial_merge_size ** 2)

        def patches_of(batch: dict) -> float:
            enc = batch.get("encoder_image_tokens")
            return float(enc.sum()) * per_token if enc is not None else float(sum(count(batch)))

        feed.patches_of = patches_of


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
                           group=pstate.modules[LANGUAGE].dp_gloo, group_size=spec.dp, enabled=enabled,
                           per_gpu=layout.colocated)
