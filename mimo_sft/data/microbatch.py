"""One rank-local micro-batch per DataLoader item, and the iterator that serves them.

``MicroBatchDataset[indices]`` encodes and collates a rank's share of one global micro-batch in a
worker process; ``MicroBatchIterator`` turns a worker's error into one ``UserError`` line and keeps the
data report (images decoded, bad samples skipped). Apart from ``data.loader`` (which builds them) so that
the index-mode reordering dataset (``data.indexed``) can extend the dataset without importing the loader.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from mimo_sft.data.preprocess import SamplePreprocessor, TruncatedImageError, collate
from mimo_sft.data.sampler import CanonicalSampler
from mimo_sft.data.sources import SFTSource
from mimo_sft.errors import BadRowError, BadSampleError, UserError

log = logging.getLogger("mimo_sft.data")

ERROR_KEY = "__user_error__"
#: what a worker reports beside a micro-batch (bad samples, images decoded); the iterator pops it
SIDE_KEY = "__data_report__"
STATS_KEY = "__reorder_stats__"


class MicroBatchDataset(torch.utils.data.Dataset):
    """Item = one rank-local micro-batch: ``ds[list_of_indices]`` -> design.md dict.

    ``max_bad_samples > 0``: a sample whose image cannot be read becomes a stand-in of the same row
    (:meth:`encode`) and is reported beside the batch (``__bad_samples__``), for the iterator to
    count, name and limit; 0 refuses it (one line), as before.
    """

    def __init__(self, source: SFTSource, pre: SamplePreprocessor, *, need_pixels: bool, on_truncation: str = "drop",
                 pad_to_seq_length: bool = True, keep_slice: tuple[int, int] | None = None, max_bad_samples: int = 0,
                 pixel_slice: tuple[int, int] | None = None):
        self.source, self.pre = source, pre
        self.need_pixels = need_pixels
        self.on_truncation = on_truncation
        self.pad_to_seq_length = pad_to_seq_length
        self.keep_slice = keep_slice
        self.max_bad_samples = max_bad_samples
        #: colocated layouts: only the samples at these positions of the (kept) micro-batch are
        #: decoded -- this rank's encoder slice; the batch's pixels are then that slice's only
        self.pixel_slice = pixel_slice
        self.dropped = 0
        #: rows replaced by the next row of their source (a bad row), this item: first index -> stand-in
        self.stood_in: dict[int, int] = {}
        self._bad: list[tuple[int, str | None, str, str]] = []  # (index, path, reason, stage)  # of the item being built

    def __len__(self) -> int:
        return len(self.source)

    def encode(self, idx: int, *, need_pixels: bool | None = None) -> dict:
        """Encode sample idx, replacing it by the next sample that fits if its images would be cut."""
        need = self.need_pixels if need_pixels is None else need_pixels
        n = len(self.source)
        j = int(idx)
        step = getattr(self.source, "next_index", None)  # a mixture: the next row of the same source
        for _ in range(n):
            try:
                messages, refs = self.source[j]
            except BadRowError as err:  # known from the row: every rank reading it skips it alike
                if self.max_bad_samples <= 0:  # named by this dataset's index, as check-data names it
                    raise BadRowError(j, err.path, err.reason) from None
                self._bad.append((j, err.path, err.reason, "row"))
                bad_j, j = j, (step(j) if step else (j + 1) % n)
                self.stood_in[bad_j] = j
                continue
            try:
                return self._encode_or_stand_in(messages, refs, j, need)
            except TruncatedImageError as err:
                if self.on_truncation == "error":
                    raise UserError(f"{err}; raise --seq-length, lower --max-pixels, or use --on-truncation drop") from None
                self.dropped += 1
                log.warning("dropped sample %d (image tokens end at %d > --seq-length %d), using sample %d instead; "
                            "%d dropped so far in this process", j, err.needed, err.seq_length,
                            step(j) if step else (j + 1) % n, self.dropped)
                j = step(j) if step else (j + 1) % n
        raise UserError(f"no sample of the dataset fits in --seq-length {self.pre.seq_length}; raise it or lower --max-pixels")

    def _encode_or_stand_in(self, messages, refs, j: int, need: bool) -> dict:
        """The sample, or (bad image, ``--max-bad-samples`` > 0) its stand-in: a missing or unreadable
        file (seen by every rank, headers are read everywhere) gives the text-only, zero-loss row; a
        header that reads but pixels that do not decode (seen only where pixels are decoded) keep
        the text and get zero pixels of the same grid, so every rank agrees on the sample's tokens."""
        try:
            return self.pre.encode(messages, refs, j, need_pixels=need)
        except BadSampleError as err:
            if self.max_bad_samples <= 0:
                raise
            self._bad.append((j, err.path, err.reason, getattr(err, "stage", "header")))
            if getattr(err, "stage", None) != "pixels":
                return self.pre.text_only_stand_in(messages, j)
            sample = self.pre.encode(messages, refs, j, need_pixels=False)
            sample["pixel_values"], sample["image_grid_thw"] = self.pre.blank_pixels(sample.get("pixel_grids", sample["grids"]))
            sample["blank_images"] = len(sample["grids"])
            return sample

    def stand_in(self, j: int) -> int:
        """The sample that was read for index ``j`` in this item (``j`` itself unless it was a bad row)."""
        while j in self.stood_in:
            j = self.stood_in[j]
        return j

    def collate(self, samples: list[dict], need_pixels: bool) -> dict:
        batch = collate(samples, pad_id=self.pre.pad_id, need_pixels=need_pixels, pixel_dim=self.pre.pixel_dim,
                        seq_length=self.pre.seq_length if self.pad_to_seq_length else None)
        decoded = sum(len(s["grids"]) - s.get("blank_images", 0) for s in samples if "pixel_values" in s)
        if hasattr(self.source, "source_of"):  # a mixture: each row's source, for the per-source losses
            batch["source_ids"] = self.source.source_of(batch["sample_ids"])
        clips = [s for s in samples if "pixel_values" in s and s.get("clips") and not s.get("blank_images")]
        batch[SIDE_KEY] = {"bad_samples": self._bad, "images_decoded": decoded if need_pixels else 0,
                           "video_frames_decoded": sum(f for s in clips for f, _ in s["clips"]) if need_pixels else 0,
                           "video_decode_s": sum(s.get("video_decode_s", 0.0) for s in clips) if need_pixels else 0.0}
        self._bad = []
        return batch

    def __getitem__(self, indices) -> dict:
        self._bad, self.stood_in = [], {}
        lo, hi = self.keep_slice if self.keep_slice is not None else (0, len(indices))
        p0, p1 = (lo + self.pixel_slice[0], lo + self.pixel_slice[1]) if self.pixel_slice else (lo, hi)
        try:  # positions outside the kept range are encoded too (non-scalable DP reads everything)
            samples = [self.encode(i, need_pixels=self.need_pixels and p0 <= k < p1) for k, i in enumerate(indices)]
        except UserError as err:  # crosses worker processes as data, re-raised as one line
            return {ERROR_KEY: str(err)}
        return self.collate(samples[lo:hi], self.need_pixels)


def skipped_line(index: int, path, reason: str, count: int, limit: int) -> str:
    """The log line of a bad sample met for the first time (``count``: distinct ones so far, this one included)."""
    return (f"skipped bad sample {index} ({path or 'in-dataset bytes'}): {reason}; {count} skipped so far "
            f"(--max-bad-samples {limit})")


def too_many_bad_samples(bad: dict, limit: int) -> str:
    """The refusal once more distinct bad samples than ``limit`` were met (``bad``: index -> (where, reason)).
    Samples, not images: a clip that does not decode, or a row that cannot be trained on, counts the same."""
    named = "; ".join(f"{i} ({p or 'in-dataset bytes'})" for i, (p, _r) in sorted(bad.items()))
    return (f"{len(bad)} samples could not be read, more than --max-bad-samples {limit}: samples {named}; fix or "
            f"remove those samples (their images, clips or rows), or raise --max-bad-samples")


def identity(x):
    return x


def data_loader(dataset, sampler, *, workers: int, seed: int, pin_memory: bool = False):
    """The DataLoader of one micro-batch stream: each item is one whole micro-batch (``batch_size=None``),
    ``workers`` processes each keeping two prefetched. Its own generator: starting an iterator draws a
    base seed, which must not move the global torch RNG (a resumed run starts its iterator at another
    step than the continuous run)."""
    return torch.utils.data.DataLoader(
        dataset, sampler=sampler, batch_size=None, collate_fn=identity, num_workers=workers,
        persistent_workers=workers > 0, prefetch_factor=2 if workers > 0 else None,
        worker_init_fn=worker_init if workers > 0 else None, pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )


def worker_init(_worker_id: int) -> None:
    """One intra-op thread per worker: workers already run in parallel, and torch's thread pool in
    each of them oversubscribes the cores (measured slower on a 2-core machine)."""
    torch.set_num_threads(1)


class MicroBatchIterator:
    """Endless iterator of micro-batch dicts; ``UserError`` from any worker is raised here as one line.

    It also keeps the data report of what it served: images decoded, and the bad samples skipped
    (each named once in the log; more distinct ones than ``max_bad_samples`` stop the run with one
    line naming them). ``last_report`` is the last micro-batch's, ``images_decoded`` /
    ``bad_samples`` the running totals of this process.

    A training run counts the bad samples over all its ranks instead (``train.bad_samples``: distinct samples,
    one log line each, one limit): it sets ``tally_here`` off, and takes each sample this process meets for the
    first time from ``first_seen``, ``(index, where, reason)``, a deque (the reorder thread may be the reader).
    """

    def __init__(self, loader, sampler: CanonicalSampler, dataset: MicroBatchDataset):
        self.loader, self.sampler, self.dataset = loader, sampler, dataset
        self._it = iter(loader)
        self.images_decoded = 0
        self.video_frames_decoded, self.video_decode_s = 0, 0.0
        self.bad_samples: dict[int, tuple[str | None, str]] = {}
        # header and row: every rank that reads the sample sees it; pixels: decoding ranks only
        self.bad_by_stage = {"header": 0, "pixels": 0, "row": 0}
        self.tally_here = True
        self.first_seen: deque = deque()
        self.last_report: dict = {"bad_samples": [], "images_decoded": 0}
        self.last_stats: dict = {}  # index-mode reordering: the plan figures of the last micro-batch

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        if ERROR_KEY in batch:
            raise UserError(batch[ERROR_KEY])
        report = batch.pop(SIDE_KEY, None) or {"bad_samples": [], "images_decoded": 0}
        self.last_stats = batch.pop(STATS_KEY, {})
        self.last_report = report
        self.images_decoded += report["images_decoded"]
        self.video_frames_decoded += report.get("video_frames_decoded", 0)
        self.video_decode_s += report.get("video_decode_s", 0.0)
        limit = self.dataset.max_bad_samples
        for index, path, reason, stage in report["bad_samples"]:
            if index in self.bad_samples:
                continue
            self.bad_samples[index] = (path, reason)
            self.bad_by_stage[stage] += 1
            if self.tally_here:
                log.warning(skipped_line(index, path, reason, len(self.bad_samples), limit))
            else:
                self.first_seen.append((index, path, reason))
        if self.tally_here and len(self.bad_samples) > limit:
            raise UserError(too_many_bad_samples(self.bad_samples, limit))
        return batch

    def shutdown(self) -> None:
        """Nothing to stop (the DataLoader's workers end with it); the feed calls this on any source."""
