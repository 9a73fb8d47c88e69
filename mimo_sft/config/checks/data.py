"""Checks 13, 14, 17 and 19: reordering, scalable data parallelism, the dataset flags, in-batch packing."""

from __future__ import annotations

import os

from mimo_sft.config.checks.context import looks_local
from mimo_sft.config.mixture import (is_streamed, mixture_problems, mixture_specs, path_exists,
                                     random_access_problems)


def c13_reorder(ctx):
    r = ctx.cfg.reorder
    if not r.enabled:
        return
    if not ctx.cfg.parallel.scalable_dp:
        yield "--intra-microbatch-reorder needs --scalable-dp (each rank must hold only its shard)"
    if not ctx.cfg.data.pad_to_seq_length:
        yield ("--intra-microbatch-reorder needs --pad-to-seq-length: exchanged samples are concatenated "
               "into one micro-batch, so every rank must pad to the same width")
    if r.encoder_cost_weight < 0 or r.language_cost_weight < 0:
        yield "--reorder-encoder-cost-weight and --reorder-language-cost-weight must be >= 0"
    elif r.encoder_cost_weight == 0 and r.language_cost_weight == 0:
        yield "both reorder cost weights are 0; set --reorder-encoder-cost-weight (only their ratio matters)"
    if r.window_size < 1:
        yield f"--reorder-window-size={r.window_size} must be >= 1"
    if ctx.layout is not None and all(s.dp == 1 for s in ctx.specs):
        yield ("--intra-microbatch-reorder with every module at dp=1 has nothing to balance", "note")


def c14_scalable_dp(ctx):
    if not ctx.cfg.parallel.scalable_dp:
        return
    d = ctx.cfg.data
    if not d.drop_last:
        yield "--scalable-dp needs --drop-last: every canonical group must be full in every micro-batch"
    for s in ctx.specs:
        if s.etp is not None and s.etp > 1:
            yield f"{s.name}.etp={s.etp}: expert tensor parallelism > 1 is rejected with --scalable-dp; set etp=1"


def c17_data(ctx):
    d = ctx.cfg.data
    if d.datasets or d.dataset_weights:
        yield from _mixture(d)
    if d.datasets:
        pass  # each source's path: _mixture
    elif d.dataset_path is None:
        if ctx.for_run:
            yield "no dataset: give --dataset-path (parquet/json/jsonl file or folder, or a save_to_disk folder)"
        else:
            yield ("--dataset-path not given: the data was not checked (finetune needs it)", "note")
    elif not path_exists(d.dataset_path) and looks_local(d.dataset_path):
        yield f"--dataset-path {d.dataset_path}: not found; give a parquet/json/jsonl file or folder, or a save_to_disk folder"
    elif is_streamed(d):
        yield from random_access_problems(d, f"--dataset-path {d.dataset_path}")
    if d.min_pixels is not None and d.max_pixels is not None and d.min_pixels > d.max_pixels:
        yield f"--min-pixels={d.min_pixels} is above --max-pixels={d.max_pixels}"
    if d.video_fps <= 0:
        yield f"--video-fps={d.video_fps} must be > 0 (frames sampled per second of a clip)"
    if d.video_min_frames is not None and d.video_max_frames is not None and d.video_min_frames > d.video_max_frames:
        yield f"--video-min-frames={d.video_min_frames} is above --video-max-frames={d.video_max_frames}"
    if d.video_min_pixels is not None and d.video_max_pixels is not None and d.video_min_pixels > d.video_max_pixels:
        yield f"--video-min-pixels={d.video_min_pixels} is above --video-max-pixels={d.video_max_pixels}"
    if d.max_image_pixels < 0:
        yield f"--max-image-pixels={d.max_image_pixels} must be >= 0 (0: no limit)"
    if d.image_root and not os.path.isdir(d.image_root):
        yield f"--image-root {d.image_root}: folder not found"


def c19_packing(ctx):
    d, m = ctx.cfg.data, ctx.cfg.model
    if m.attention_backend == "varlen" and m.dtype != "bf16":
        yield (f"--attention-backend varlen runs torch's variable-length flash kernel, which takes half precision "
               f"only: use --dtype bf16, or --attention-backend auto (it picks varlen where it runs)")
    yield from _context_parallel(ctx)
    if not d.in_batch_packing:
        return
    if m.attention_backend == "local":
        yield (f"--in-batch-packing with --attention-backend {m.attention_backend}: megatron's local core attention "
               f"cannot keep packed samples apart; use --attention-backend auto (the default), or "
               f"--no-in-batch-packing to compute padded rows")


def _context_parallel(ctx):
    """Language context parallelism (``model.context_parallel``): our attention core only, and sequences long
    enough to cut into 2*cp chunks."""
    lang = next((s for s in ctx.specs if s.name == "language"), None)
    if lang is None or lang.cp <= 1:
        return
    d, m = ctx.cfg.data, ctx.cfg.model
    if m.attention_backend == "local":
        yield (f"--attention-backend local with language.cp={lang.cp}: megatron's local core attention refuses "
               f"context parallelism; use --attention-backend auto (the default), which runs it")
    if d.seq_length < 2 * lang.cp:
        yield (f"--seq-length={d.seq_length} is shorter than 2*cp={2 * lang.cp}: each document is cut into 2*cp "
               f"chunks, one pair per cp rank; raise --seq-length or lower language.cp")


def _mixture(d):
    """The mixture's settings (weights, names, keys; one line each naming the source), then each
    source's files and image folder."""
    problems = mixture_problems(d)
    yield from problems
    if problems or not d.datasets:
        return
    for spec in mixture_specs(d):
        s = spec.data
        if not path_exists(s.dataset_path) and looks_local(s.dataset_path):
            yield f"source '{spec.name}': {s.dataset_path} not found; give a parquet/json/jsonl file or folder"
        elif is_streamed(s):
            yield from random_access_problems(s, f"source '{spec.name}'")
        if s.valid_dataset_path and not os.path.exists(s.valid_dataset_path) and looks_local(s.valid_dataset_path):
            yield f"source '{spec.name}': validation set {s.valid_dataset_path} not found"
        if s.image_root and not os.path.isdir(s.image_root):
            yield f"source '{spec.name}': image_root {s.image_root}: folder not found"
