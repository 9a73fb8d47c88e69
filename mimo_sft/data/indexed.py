"""Reordering by index (``--reorder-mode index``): balance a micro-batch without moving a pixel.

The exchange (``data.reorder.exchange``) has every rank read its canonical shard, decode it, then
all-gather the costs and ship the samples the balanced plan moves (51-69 % of them at DP 4-16, as
pixels). Here no sample crosses ranks: every rank runs the same planner on the same per-sample
costs of the whole global micro-batch (:func:`window_plan.window_plan_info`, the one place that
decides a layout), so every rank knows the whole assignment, and then reads and decodes only the
samples it owns, in canonical order.

Where the costs come from (issue 33): a sample's cost needs its text path only -- image headers
(size and EXIF orientation -> grid through the processor's ``smart_resize``), the tokenizer, the
truncation rule -- never its pixels, and a row's cost does not depend on the other rows. Each rank
computes the costs of its OWN canonical shard (:class:`ShardCostDataset`, in DataLoader workers
like any other data work) and one all-gather of the small cost vectors over the module's DP group
(``reorder.cost_gather``: ``1 + 3 * per`` float64 per rank and micro-batch) gives every rank the
whole micro-batch's costs (:class:`IndexPlanner`). Per rank and micro-batch that is the text path of
``micro_batch_size / dp`` samples for the costs plus the text path (and, on encoder ranks, the
pixels) of the ``micro_batch_size / dp`` samples it owns: flat in the global micro-batch. Before,
every rank ran the text path of the whole global micro-batch (``micro_batch_size`` samples, 1.5 s of
CPU per micro-batch of 64 at 22.8 ms a sample, on every rank).

Why a gather and not a per-dataset cost column cached next to the dataset: the gather is exact by
construction (the very function the exchange applies, on the very rows), needs no fingerprint of
tokenizer, chat template, ``--seq-length`` and ``--max-pixels``, no pass over the whole dataset
before step 0 (a run reading 5 % of a 10M-row set would pay for all of it), and no cache to
invalidate; it costs one collective of a few hundred bytes per micro-batch, on the gloo DP group
reserved for the reorder thread (``parallel.groups``: ``reorder_side_gloo``), so it never interleaves
with the training thread's collectives.

Pipeline of one rank (``build_index_iterator``): a cost DataLoader over this rank's shards; the
planner pulls its items, gathers and plans -- on a thread when that loader has workers, so the
training thread never waits on a collective, inline otherwise -- and queues one job per micro-batch
(the dataset indices this rank owns, in canonical order, and the plan's figures); the sample
DataLoader's sampler serves those jobs, and its workers encode and decode the owned samples
(:class:`OwnedSamplesDataset`, the plain :class:`MicroBatchDataset` path, as the exchange reads them).

Exactness: the costs are the exchange's ``cost_fn`` applied to the same per-sample fields, the
planner is the same function, and this rank's micro-batch is the collate of its samples in canonical
order -- what the exchange's merge of the same records gives. So losses and gradients are the
exchange mode's bit for bit (``tests/test_reorder_index.py``) and the plan is the one the whole-read
path gives (``tests/test_index_costs.py``). A DP-1 module, or a caller without a group (one process
standing in for several ranks), reads the whole micro-batch itself (:class:`IndexReorderedDataset`):
there the shard is the micro-batch, or there is no one to gather from.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from functools import partial
from typing import Any, Callable, Iterator, Mapping

from mimo_sft.data.microbatch import (ERROR_KEY, STATS_KEY, MicroBatchDataset, MicroBatchIterator, data_loader)
from mimo_sft.data.preprocess import collate
from mimo_sft.data.reorder import window_plan
from mimo_sft.data.reorder.cost_gather import gather_shard_costs
from mimo_sft.data.sampler import CanonicalSampler
from mimo_sft.errors import BadSampleError, UserError
from mimo_sft.progress import PROGRESS

_PLAN_ONLY = ("order", "global_costs")  # plan internals the feed does not log
CostFn = Callable[[Mapping], list[float]]
#: ``plan_fn(costs, loads) -> info``: one micro-batch's plan from its GLOBAL per-sample numbers, with
#: ``window_plan.window_plan_info``'s keys (colocated layouts: ``colocated_plan.colocated_plan_info``)
PlanFn = Callable[[list, list], dict]


def window_plan_one(costs: list, loads: list, *, n_groups: int, dp_size: int,
                    stats_dp_sizes: Mapping[str, int] | None) -> dict:
    """The default plan: ``window_plan.window_plan_info`` of a one-slot window."""
    return window_plan.window_plan_info([costs], [loads], n_groups=n_groups, dp_size=dp_size,
                                        stats_dp_sizes=stats_dp_sizes)[0]


def _plan_stats(info: dict, exchange_s: float) -> dict:
    """What a micro-batch carries beside it (``STATS_KEY``): the plan's figures and its order."""
    stats = {k: v for k, v in info.items() if k not in _PLAN_ONLY}
    stats.update(order=info["order"], reorder_exchange_s=exchange_s, reorder_wait_s=0.0, reorder_bytes=0)
    return stats


class IndexReorderedDataset(MicroBatchDataset):
    """Whole-read path. Item = the indices of one whole global micro-batch -> this rank's balanced share.

    ``cost_fn`` / ``load_fn`` / ``n_groups`` / ``stats_dp_sizes`` are the ones the exchange would get
    (``train.feed`` builds both modes from the same values).
    """

    def __init__(self, source, pre, *, dp_rank: int, dp_size: int, n_groups: int, cost_fn: CostFn,
                 load_fn: CostFn | None = None, stats_dp_sizes: Mapping[str, int] | None = None,
                 plan_fn: PlanFn | None = None, **kw):
        super().__init__(source, pre, **kw)
        if n_groups % dp_size:
            raise ValueError(f"DP size {dp_size} does not divide the canonical grid {n_groups}")
        self.dp_rank, self.dp_size, self.n_groups = dp_rank, dp_size, n_groups
        self.cost_fn, self.load_fn = cost_fn, load_fn
        self.stats_dp_sizes = dict(stats_dp_sizes or {})
        self.plan_fn = plan_fn or partial(window_plan_one, n_groups=n_groups, dp_size=dp_size,
                                          stats_dp_sizes=self.stats_dp_sizes)

    def plan(self, texts: list[dict]) -> dict:
        """The exchange's plan for this micro-batch, from the text path of all its samples."""
        fields = self.collate(texts, need_pixels=False)
        costs = [float(c) for c in self.cost_fn(fields)]
        loads = [float(c) for c in self.load_fn(fields)] if self.load_fn else costs
        return self.plan_fn(costs, loads)

    def add_pixels(self, sample: dict) -> dict:
        """Decode the images of one (owned) sample; a text-only stand-in has none to decode."""
        if not sample["grids"] or "pixel_values" in sample:
            return sample
        sid = sample["sample_id"]
        messages, refs = self.source[sid]
        try:
            specs, _ = self.pre.fitted_specs(messages, refs, sid)
            sample["pixel_values"], sample["image_grid_thw"] = self.pre.pixels(specs, sid)
        except BadSampleError as err:  # same stand-in as the exchange mode's (MicroBatchDataset.encode)
            if self.max_bad_samples <= 0:
                raise
            self._bad.append((sid, err.path, err.reason, "pixels"))
            sample["pixel_values"], sample["image_grid_thw"] = self.pre.blank_pixels(sample.get("pixel_grids", sample["grids"]))
            sample["blank_images"] = len(sample["grids"])
        return sample

    def __getitem__(self, indices) -> dict:
        self._bad, self.stood_in = [], {}
        try:
            texts = [self.encode(i, need_pixels=False) for i in indices]
            info = self.plan(texts)
            per = len(texts) // self.dp_size
            mine = [texts[k] for k in info["order"][self.dp_rank * per: (self.dp_rank + 1) * per]]
            owned = {s["sample_id"] for s in mine}
            # every rank read them; count each once (a bad row: where the row that stood in for it is owned)
            self._bad = [b for b in self._bad if self.stand_in(b[0]) in owned]
            if self.need_pixels:  # colocated: only this rank's encoder slice (pixel_slice) is decoded
                lo, hi = self.pixel_slice or (0, len(mine))
                mine = [self.add_pixels(s) if lo <= k < hi else s for k, s in enumerate(mine)]
        except UserError as err:  # crosses worker processes as data, re-raised as one line
            return {ERROR_KEY: str(err)}
        batch = self.collate(mine, self.need_pixels)
        batch[STATS_KEY] = _plan_stats(info, 0.0)
        return batch


class ShardCostDataset(MicroBatchDataset):
    """Item = this rank's shard of one global micro-batch -> its samples' ``indices``, ``costs`` and
    ``loads`` (text path only: headers and tokens, no pixel). Bad samples met here are not reported:
    the owner of each sample meets them again when it reads the sample, and reports them once."""

    def __init__(self, source, pre, *, cost_fn: CostFn, load_fn: CostFn | None = None, counts=None,
                 count_costs=None, **kw):
        super().__init__(source, pre, need_pixels=False, **kw)
        self.cost_fn, self.load_fn = cost_fn, load_fn
        #: a cost file's per-row counts (``data.cost_file.SourceCounts``) and the formula that turns
        #: ``(tokens, image tokens)`` into ``(costs, loads)``; rows without a count are encoded
        self.counts, self.count_costs = counts, count_costs

    def __getitem__(self, indices) -> dict:
        self._bad = []
        n = len(indices)
        known = [self.counts.counts(i) for i in indices] if self.counts else [None] * n
        costs, loads = [0.0] * n, [0.0] * n
        todo = [k for k, c in enumerate(known) if c is None]
        if todo:
            try:
                texts = [self.encode(indices[k], need_pixels=False) for k in todo]
            except UserError as err:
                return {ERROR_KEY: str(err)}
            fields = collate(texts, pad_id=self.pre.pad_id, need_pixels=False, pixel_dim=self.pre.pixel_dim,
                             seq_length=self.pre.seq_length if self.pad_to_seq_length else None)
            got = [float(c) for c in self.cost_fn(fields)]
            for k, c, ld in zip(todo, got, [float(c) for c in self.load_fn(fields)] if self.load_fn else got):
                costs[k], loads[k] = c, ld
        have = [k for k, c in enumerate(known) if c is not None]
        if have:
            got, got_loads = self.count_costs([known[k][0] for k in have], [known[k][1] for k in have])
            for k, c, ld in zip(have, got, got_loads if self.load_fn else got):
                costs[k], loads[k] = c, ld
        return {"indices": [int(i) for i in indices], "costs": costs, "loads": loads}


class OwnedSamplesDataset(MicroBatchDataset):
    """Item = a planner job -> this rank's balanced micro-batch: the owned samples read (and, on
    encoder ranks, decoded) in canonical order by the plain path, with the plan's figures beside it."""

    def __getitem__(self, job) -> dict:
        if "error" in job:
            return {ERROR_KEY: job["error"]}
        batch = super().__getitem__(job["indices"])
        if ERROR_KEY not in batch:
            batch[STATS_KEY] = job["stats"]
        return batch


class _Failure:
    """An exception raised on the planner thread, carried to the sampler (training thread)."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class IndexPlanner:
    """Shard costs in, one job per micro-batch out: ``{"indices": owned dataset indices in canonical
    order, "stats": the plan's figures}``, or ``{"error": one line}`` that every rank gets alike.

    ``threaded``: plan ahead on a daemon thread (at most ``depth`` jobs queued) -- only when the
    costs come from DataLoader workers, so that the thread itself runs no dataset code beside the
    training thread's."""

    def __init__(self, costs: Iterator[dict], *, group: Any, dp_rank: int, dp_size: int, n_groups: int, per: int,
                 stats_dp_sizes: Mapping[str, int] | None, threaded: bool, depth: int = 2,
                 plan_fn: PlanFn | None = None):
        self.costs, self.group = costs, group
        self.dp_rank, self.dp_size, self.n_groups, self.per = dp_rank, dp_size, n_groups, per
        self.stats_dp_sizes = dict(stats_dp_sizes or {})
        self.plan_fn = plan_fn or partial(window_plan_one, n_groups=n_groups, dp_size=dp_size,
                                          stats_dp_sizes=self.stats_dp_sizes)
        self.threaded = threaded
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def plan_one(self) -> dict:
        """Next micro-batch: pull this rank's shard costs, gather every rank's, plan (collective)."""
        item = next(self.costs)
        t0 = time.perf_counter()
        error = item.get(ERROR_KEY)
        # inline, the training thread waits here for its DP peers: a phase of its own (the watchdog, the
        # straggler report), not this rank's data work; the planner thread marks nothing
        with PROGRESS.nested("reorder wait") if not self.threaded else contextlib.nullcontext():
            got = gather_shard_costs(item.get("indices", ()), item.get("costs", ()), item.get("loads", ()),
                                     per=self.per, dp_size=self.dp_size, group=self.group, error=error)
        if isinstance(got, str):
            return {"error": got}
        indices, costs, loads = got
        info = self.plan_fn(costs, loads)
        mine = info["order"][self.dp_rank * self.per: (self.dp_rank + 1) * self.per]
        return {"indices": [indices[p] for p in mine], "stats": _plan_stats(info, time.perf_counter() - t0)}

    def jobs(self) -> Iterator[dict]:
        """The jobs in micro-batch order (the sample loader's sampler iterates this)."""
        if not self.threaded:
            while True:
                yield self.plan_one()
        if self._thread is None:  # started on the first pull: after the sample loader forked its workers
            self._thread = threading.Thread(target=self._run, name=f"index-plan-dp{self.dp_rank}", daemon=True)
            self._thread.start()
        while True:
            item = self.queue.get()
            if isinstance(item, _Failure):
                raise item.exc.with_traceback(item.exc.__traceback__)
            yield item

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self._put(self.plan_one()):
                    return
        except BaseException as exc:  # noqa: BLE001 - everything must reach the training thread
            self._put(_Failure(exc))

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop planning ahead. A thread inside a collective cannot be interrupted; it is a daemon."""
        self.stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout)


class PlanSampler:
    """The sample loader's sampler: the planner's jobs, one per micro-batch (endless, like the canonical one)."""

    def __init__(self, planner: IndexPlanner):
        self.planner = planner

    def __iter__(self) -> Iterator[dict]:
        return self.planner.jobs()


class IndexedIterator(MicroBatchIterator):
    """The micro-batch iterator of the gathered path; shutting it down stops the planner."""

    def __init__(self, loader, sampler, dataset, planner: IndexPlanner):
        self.planner = planner
        super().__init__(loader, sampler, dataset)

    def shutdown(self) -> None:
        self.planner.shutdown()

    def __del__(self) -> None:  # the thread holds the planner, not this iterator: a dropped one stops it
        try:
            self.planner.shutdown(timeout=0.5)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def build_index_iterator(source, pre, *, sampler_kw: dict, group: Any, dp_rank: int, dp_size: int,
                         n_groups: int, cost_fn: CostFn, load_fn: CostFn | None = None,
                         stats_dp_sizes: Mapping[str, int] | None = None, workers: int, seed: int,
                         pin_memory: bool = False, cost_folder=None, count_costs=None,
                         plan_fn: PlanFn | None = None, **common) -> MicroBatchIterator:
    """This rank's index-mode iterator. ``sampler_kw``: this rank's :class:`CanonicalSampler`
    arguments; ``group``: the gloo DP group for the cost gather (None, or a DP-1 module: the
    whole-read path); ``workers``: the sample loader's workers, the cost loader gets half of them (at
    least one when there are any); ``common``: the :class:`MicroBatchDataset` options;
    ``cost_folder``/``count_costs``: where ``check-data --write-costs`` put the sources' counts, and
    their cost formula (``data.cost_file``: a source with a file is planned without reading rows);
    ``plan_fn``: the plan of one micro-batch from the gathered numbers (default: the window plan of a
    module of ``dp_size``; colocated layouts: the per-GPU plan, ``data.reorder.colocated_plan``)."""
    if n_groups % dp_size:
        raise ValueError(f"DP size {dp_size} does not divide the canonical grid {n_groups}")
    plan_kw = dict(n_groups=n_groups, cost_fn=cost_fn, load_fn=load_fn, stats_dp_sizes=stats_dp_sizes,
                   plan_fn=plan_fn)
    whole = group is None or dp_size == 1  # then every rank reads the whole micro-batch's text path
    sampler = CanonicalSampler(dp_size=dp_size, dp_rank=dp_rank, whole_micro_batch=whole, seed=seed, **sampler_kw)
    if whole:
        dataset = IndexReorderedDataset(source, pre, dp_rank=dp_rank, dp_size=dp_size, **plan_kw, **common)
        loader = data_loader(dataset, sampler, workers=workers, seed=seed, pin_memory=pin_memory)
        return MicroBatchIterator(loader, sampler, dataset)
    cost_workers = max(1, workers // 2) if workers > 0 else 0
    cost_common = {k: v for k, v in common.items() if k not in ("need_pixels", "pixel_slice")}
    counts, stale = None, []
    if cost_folder is not None and count_costs is not None:
        from mimo_sft.data.cost_file import SourceCounts, load_cost_tables, other_settings, parts_of

        tables = load_cost_tables(source, pre, cost_folder)
        stale = [why for part, t in zip(parts_of(source), tables) if t is None
                 and (why := other_settings(part, pre, cost_folder))]
        counts = SourceCounts(source, tables) or None
    costs = ShardCostDataset(source, pre, cost_fn=cost_fn, load_fn=load_fn, counts=counts, count_costs=count_costs,
                             **cost_common)
    cost_loader = data_loader(costs, sampler, workers=cost_workers, seed=seed)
    planner = IndexPlanner(iter(cost_loader), group=group, dp_rank=dp_rank, dp_size=dp_size, n_groups=n_groups,
                           per=sampler.mbs // dp_size, stats_dp_sizes=stats_dp_sizes, threaded=cost_workers > 0,
                           plan_fn=plan_fn)
    owned = OwnedSamplesDataset(source, pre, **common)
    plans = PlanSampler(planner)
    loader = data_loader(owned, plans, workers=workers, seed=seed, pin_memory=pin_memory)
    it = IndexedIterator(loader, sampler, owned, planner)
    it.cost_files = [t.path for t in counts.tables if t is not None] if counts else []  # said in the banner
    it.cost_notes = stale  # cost files made for other settings: said in the banner
    return it
