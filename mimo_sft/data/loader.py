"""The entry points the training loop and the planner call: micro-batch iterator, metadata, stats.

Why a DataLoader over *micro-batches*: the sampler already decides which indices form this rank's
share of global micro-batch k, so each DataLoader item is one whole (rank-local) micro-batch. Worker
processes then encode and collate in parallel while the stream order stays exactly the sampler's.

Truncation policy: a sample whose image tokens would be cut by ``seq_length`` is never truncated.
With ``on_truncation=drop`` it is replaced by the next dataset index that fits (a pure function of
the dataset, so every module and rank makes the same choice without talking) and a counted warning
is logged; with ``error`` a ``UserError`` names the sample.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from mimo_sft.data.model_folder import (build_preprocessor, fitted_pixels_note,  # noqa: F401 - their home before
                                        model_token_info, video_options)
from mimo_sft.data.microbatch import (ERROR_KEY, MicroBatchDataset, MicroBatchIterator, data_loader, identity,
                                      worker_init)
from mimo_sft.data.preprocess import SamplePreprocessor
from mimo_sft.data.mixture import MixtureSource
from mimo_sft.data.sampler import CanonicalSampler
from mimo_sft.data.source_probe import too_few_samples
from mimo_sft.data.sources import SFTSource, load_sft_dataset
from mimo_sft.errors import UserError

log = logging.getLogger("mimo_sft.data")


def check_fits(source: SFTSource, pre: SamplePreprocessor, *, micro_batch_size: int, global_batch_size: int | None = None):
    """User-facing size checks shared by the iterator and ``validate``."""
    few = too_few_samples(len(source), micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    if few and not isinstance(source, MixtureSource):  # a mixture's sources repeat: any size fills a batch
        raise UserError(few)
    one = pre.min_tokens_for_one_image()
    if one > pre.seq_length:
        raise UserError(f"--seq-length {pre.seq_length} is too short for one image at --max-pixels {pre.max_pixels} "
                        f"({one} tokens with the chat template); raise --seq-length or lower --max-pixels")


def build_microbatch_iterator(data_cfg, *, model_dir, micro_batch_size: int, canonical_grid: int, dp_size: int,
                              dp_rank: int, need_pixels: bool, seed: int, consumed_samples: int = 0,
                              scalable_dp: bool = True, global_batch_size: int | None = None,
                              num_workers: int | None = None, source: SFTSource | None = None,
                              preprocessor: SamplePreprocessor | None = None, index_reorder: dict | None = None,
                              pin_memory: bool = False, pixel_slice: slice | None = None) -> MicroBatchIterator:
    """This rank's endless stream of micro-batch dicts (design.md), starting after ``consumed_samples``.

    ``need_pixels=False`` (language-only ranks) never decodes pixels. Without ``scalable_dp`` every
    rank encodes the whole micro-batch and keeps its slice (same result, more I/O).
    ``index_reorder``: reorder by index (``data.indexed``): the arguments of
    :func:`~mimo_sft.data.indexed.build_index_iterator` beyond the data ones (cost and load
    functions, canonical grid, stats DP sizes, and ``group``, the gloo DP group its cost gather
    uses); this rank then reads its shard's text path for the costs, gathers every shard's, and
    reads and decodes only the samples the balanced plan gives it (without a group: the whole
    micro-batch's text path, one process standing in for a rank). ``pin_memory``: the DataLoader
    pins each micro-batch in its own thread (CUDA runs), not the training thread. ``pixel_slice``
    (colocated layouts): decode only the samples of this slice of the rank's micro-batch (its
    encoder slice, ``data.colocated``); ``pixel_values`` then hold that slice's images only.
    """
    source = source if source is not None else load_sft_dataset(data_cfg)
    pre = preprocessor if preprocessor is not None else build_preprocessor(data_cfg, model_dir)
    # micro_batch_size % canonical_grid and canonical_grid % dp_size: check_config refuses the first
    # (check 8), the grid is the LCM of the DP sizes; the sampler asserts both
    check_fits(source, pre, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    sampler_kw = dict(total_samples=len(source), micro_batch_size=micro_batch_size, canonical_grid=canonical_grid,
                      dataloader_type=data_cfg.dataloader_type, drop_last=data_cfg.drop_last,
                      consumed_samples=consumed_samples)
    if isinstance(source, MixtureSource):  # the weighted interleave with per-source epochs (data.mixture)
        sampler_kw["order"] = source.order(seed=seed, shuffle=data_cfg.dataloader_type == "cyclic")
    common = dict(need_pixels=need_pixels, on_truncation=data_cfg.on_truncation,
                  pad_to_seq_length=data_cfg.pad_to_seq_length, max_bad_samples=data_cfg.max_bad_samples)
    local = micro_batch_size // dp_size if scalable_dp or index_reorder is not None else micro_batch_size
    mb_bytes = micro_batch_bytes(pre, local, need_pixels=need_pixels)
    workers = resolve_num_workers(data_cfg.num_workers if num_workers is None else num_workers,
                                  micro_batch_bytes=mb_bytes)
    warning = shm_warning(workers, micro_batch_bytes=mb_bytes)
    if warning:
        log.warning(warning)
    cut = (pixel_slice.start, pixel_slice.stop) if pixel_slice is not None else None
    if index_reorder is not None:
        from mimo_sft.data.indexed import build_index_iterator

        return build_index_iterator(source, pre, sampler_kw=sampler_kw, dp_rank=dp_rank, dp_size=dp_size,
                                    workers=workers, seed=seed, pin_memory=pin_memory, pixel_slice=cut,
                                    **{"group": None, **index_reorder}, **common)
    sampler = CanonicalSampler(dp_size=dp_size, dp_rank=dp_rank, seed=seed, whole_micro_batch=not scalable_dp,
                               **sampler_kw)
    dataset = MicroBatchDataset(source, pre, keep_slice=None if scalable_dp else sampler.slice, pixel_slice=cut,
                                **common)
    loader = data_loader(dataset, sampler, workers=workers, seed=seed, pin_memory=pin_memory)
    return MicroBatchIterator(loader, sampler, dataset)


def shm_warning(workers: int, *, micro_batch_bytes: int, local_ranks: int | None = None,
                free_bytes: int | None = None) -> str | None:
    """The one-line warning (or None) when /dev/shm cannot hold what the node's DataLoader workers
    keep in flight: every worker of every rank on the node hands over 2 prefetched micro-batches
    through shared memory; a container's default 64 MB ends in a bus error, not a message."""
    import shutil

    if workers <= 0:
        return None
    local_ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if free_bytes is None:
        try:
            free_bytes = shutil.disk_usage("/dev/shm").free
        except OSError:
            return None
    need = workers * 2 * local_ranks * micro_batch_bytes
    if need <= free_bytes:
        return None
    return (f"/dev/shm has {free_bytes / 2**20:.0f} MiB free, but {local_ranks} rank(s) x {workers} DataLoader "
            f"worker(s) x 2 prefetched micro-batches need up to {need / 2**20:.0f} MiB; give the container more "
            f"(docker run --shm-size={max(1, -(-2 * need // 2**30))}g) or lower --num-workers")


def micro_batch_bytes(pre: SamplePreprocessor, samples: int, *, need_pixels: bool) -> int:
    """Largest host bytes of one rank-local micro-batch: the text fields (design.md, padded to
    seq_length, about 53 bytes per position) and, on encoder ranks, one image at ``max_pixels`` per
    sample as uint8 patches (3 bytes per pixel)."""
    per = pre.seq_length * (8 * 3 + 4 + 1 + 8 + 8 * 3) + (3 * pre.max_pixels if need_pixels else 0)
    return samples * per


def resolve_num_workers(requested: int, *, cpus: int | None = None, local_ranks: int | None = None,
                        micro_batch_bytes: int | None = None, free_bytes: int | None = None) -> int:
    """``--num-workers``; -1 (the default) picks from the CPUs this rank may use: those of the
    process (its affinity mask) shared by the ranks of this node (``LOCAL_WORLD_SIZE``), minus one
    for the training thread, 0 when no core is left over; and, given the size of one micro-batch,
    no more workers than /dev/shm can hold the prefetched micro-batches of (2 per worker, every rank
    of the node alike; at least one worker where a core is free, :func:`shm_warning` then says so).

    Why no fixed cap: it was 4, from ``scripts/bench_data.py``'s figures on the tiny processor's
    thumbnails, where two prefetched micro-batches per worker kept a GPU fed. What a rank needs
    depends on its data instead -- encoder ranks decoding 4-12 Mpx pages spend 100-200 ms of CPU per
    image, and index mode used to add the text path of the whole global micro-batch on every rank
    (``data.indexed``) -- while a worker beyond the need costs only memory: its process and its two
    prefetched micro-batches, which is what the shared-memory bound limits."""
    if requested >= 0:
        return requested
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    local_ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = max(0, cpus // max(1, local_ranks) - 1)
    if workers and micro_batch_bytes:
        if free_bytes is None:
            import shutil

            try:
                free_bytes = shutil.disk_usage("/dev/shm").free
            except OSError:
                return workers
        workers = max(1, min(workers, free_bytes // (2 * max(1, local_ranks) * micro_batch_bytes)))
    return workers


# --------------------------------------------------------------------------- metadata (planner)

@dataclass
class SampleMeta:
    """What the planner needs per sample, computed without decoding pixels."""

    index: int
    image_patches: list[int]  # t*h*w per image (vision cost)
    image_tokens: int  # placeholders in the text (= sum(patches) / merge**2)
    n_tokens: int  # real tokens before truncation/padding
    fits: bool  # every image token within seq_length


class _MetaDataset(torch.utils.data.Dataset):
    """Item k = metadata of the k-th chunk of indices (chunks keep worker IPC per sample small)."""

    def __init__(self, source, pre, indices, chunk: int = 64):
        self.source, self.pre = source, pre
        self.chunks = [indices[i: i + chunk] for i in range(0, len(indices), chunk)]

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, k):
        try:
            return [self.one(int(i)) for i in self.chunks[k]]
        except UserError as err:
            return {ERROR_KEY: str(err)}

    def one(self, i: int) -> SampleMeta:
        messages, refs = self.source[i]
        specs, (ids, _) = self.pre.fitted_specs(messages, refs, i)  # a clip planned as training plans it
        grids = [s.grid for s in specs]
        is_img = ((ids == self.pre.image_token_id) | (ids == self.pre.video_token_id)).nonzero()
        last = int(is_img[-1]) + 1 if len(is_img) else 0
        merge2 = self.pre.merge_size ** 2
        patches = [t * h * w for t, h, w in grids]
        return SampleMeta(i, patches, sum(patches) // merge2, len(ids), last <= self.pre.seq_length)


def sample_metadata(data_cfg, *, model_dir, indices=None, num_workers: int = 0, source: SFTSource | None = None,
                    preprocessor: SamplePreprocessor | None = None) -> list[SampleMeta]:
    """Per-sample image patch counts and real token counts, reading only image headers (in order)."""
    source = source if source is not None else load_sft_dataset(data_cfg)
    pre = preprocessor if preprocessor is not None else build_preprocessor(data_cfg, model_dir)
    indices = list(range(len(source))) if indices is None else [int(i) for i in indices]
    ds = _MetaDataset(source, pre, indices)
    if num_workers <= 0:
        items: Iterator = (ds[k] for k in range(len(ds)))
    else:
        items = iter(torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=identity, num_workers=num_workers,
                                                 worker_init_fn=worker_init))
    out = []
    for item in items:
        if isinstance(item, dict):
            raise UserError(item[ERROR_KEY])
        out.extend(item)
    return out


def dataset_stats(data_cfg, *, model_dir, num_workers: int = 0, source: SFTSource | None = None,
                  preprocessor: SamplePreprocessor | None = None) -> dict:
    """Summary numbers for logs and ``validate``: sizes, image mix, token and patch spreads."""
    pre = preprocessor if preprocessor is not None else build_preprocessor(data_cfg, model_dir)
    metas = sample_metadata(data_cfg, model_dir=model_dir, num_workers=num_workers, source=source, preprocessor=pre)
    counts = [len(m.image_patches) for m in metas]
    patches = [p for m in metas for p in m.image_patches]
    tokens = [m.n_tokens for m in metas]
    return {
        "samples": len(metas),
        "images": len(patches),
        "text_only": sum(c == 0 for c in counts),
        "multi_image": sum(c > 1 for c in counts),
        "patches_per_image_min": min(patches, default=0),
        "patches_per_image_mean": (sum(patches) / len(patches)) if patches else 0.0,
        "patches_per_image_max": max(patches, default=0),
        "tokens_mean": sum(tokens) / len(tokens),
        "tokens_max": max(tokens),
        "too_long_for_images": sum(not m.fits for m in metas),
        "truncated_text": sum(m.fits and m.n_tokens > pre.seq_length for m in metas),
    }
