#!/usr/bin/env python
"""Time per clip of one loader worker: plan, decode, resize and cut 720p clips, against transformers.

    python scripts/bench_video.py [--clips 4] [--seconds 10] [--fps 2 4 8] [--width 1280 --height 720]
                                  [--family qwen2_5_vl|qwen3_vl] [--repeat 2]

Writes ``--clips`` H.264 clips of ``--seconds`` at 30 fps (a keyframe every second) into a temporary folder and
a real-shaped checkpoint's processor files (``write_preset_checkpoint``, config only: the family's video
processor defaults). For each sampling rate it times, per clip, in this one process (one thread, as a worker):

* ``ours seek``: ``ClipReader.plan`` (header) + ``pixels`` (decode the planned frames with keyframe seeks,
  resize, uint8 patches);
* ``ours decode all``: the same without seeking (frames decoded in order up to the last planned one);
* ``transformers``: ``load_video(backend="pyav")`` with the processor's ``sample_frames``, then the processor
  (float patches, normalised).

Prints a table (median seconds per clip over ``--repeat`` passes) and the frames and patches per clip.

``--reorder-samples N`` (default 256) adds a second table: N rows mixing those clips (whole, or a window),
document pages of 0.3-4 Mpx and text-only rows, planned from headers at ``--reorder-fps``; per window of
``--dp`` x ``--per-rank`` samples, the heaviest vision rank's patches over the mean, in dataset order and
after ``assign.balanced_groups`` (the planner training uses).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clips", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--fps", type=float, nargs="+", default=[2, 4, 8])
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--reorder-samples", type=int, default=256)
    p.add_argument("--reorder-fps", type=float, default=2.0)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--per-rank", type=int, default=4)
    a = p.parse_args(argv)

    import mimo_sft  # noqa: F401  (torchvision beside the CPU torch)
    import torch

    torch.set_num_threads(1)
    from transformers.video_utils import load_video

    from mimo_sft.data.image_refs import VideoRef
    from mimo_sft.data.video import ClipReader, VideoOptions
    from mimo_sft.testing.clips import write_clip
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench_video_"))
    preset = {"qwen2_5_vl": "qwen2.5-vl-3b", "qwen3_vl": "qwen3-vl-8b"}[a.family]
    ckpt = write_preset_checkpoint(tmp / "ckpt", preset)
    t0 = time.perf_counter()
    clips = [write_clip(tmp / f"c{i}.mp4", frames=int(a.seconds * 30), width=a.width, height=a.height, fps=30, gop=30)
             for i in range(a.clips)]
    print(f"wrote {a.clips} clips of {a.width}x{a.height}, {a.seconds:g} s at 30 fps in {time.perf_counter() - t0:.1f} s; "
          f"{a.family} ({preset}) video processor defaults; one thread", flush=True)
    rows = []
    for fps in a.fps:
        reader = ClipReader(ckpt, a.family, VideoOptions(fps=fps), timestamps=a.family != "qwen2_5_vl")
        vp = reader.vp
        times = {"ours seek": [], "ours decode all": [], "transformers": []}
        for _ in range(a.repeat):
            for clip in clips:
                for name, seek in (("ours seek", True), ("ours decode all", False)):
                    t = time.perf_counter()
                    plan = reader.plan(VideoRef(clip), 0)
                    rows_u8, _grid = reader.pixels(plan, 0, seek=seek)
                    times[name].append(time.perf_counter() - t)
                t = time.perf_counter()
                frames, meta = load_video(str(clip), backend="pyav",
                                          sample_indices_fn=functools.partial(vp.sample_frames, fps=fps))
                out = vp(videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
                times["transformers"].append(time.perf_counter() - t)
        t_, h_, w_ = plan.grid
        assert tuple(out["video_grid_thw"][0].tolist()) == plan.grid
        rows.append((fps, len(plan.indices), t_ * h_ * w_, {k: statistics.median(v) for k, v in times.items()}))
    # a window at the clip's end (video_start / video_end): seeking skips what decoding in order must decode
    reader = ClipReader(ckpt, a.family, VideoOptions(fps=2), timestamps=a.family != "qwen2_5_vl")
    window = {"ours seek": [], "ours decode all": []}
    for _ in range(a.repeat):
        for clip in clips:
            ref = VideoRef(clip, a.seconds - 3.0, a.seconds)
            for name, seek in (("ours seek", True), ("ours decode all", False)):
                t = time.perf_counter()
                plan = reader.plan(ref, 0)
                reader.pixels(plan, 0, seek=seek)
                window[name].append(time.perf_counter() - t)
    t_, h_, w_ = plan.grid
    print(f"\n| fps | frames | patches | ours seek (s/clip) | ours decode all (s/clip) | transformers (s/clip) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for fps, frames, patches, med in rows:
        print(f"| {fps:g} | {frames} | {patches:,} | {med['ours seek']:.3f} | {med['ours decode all']:.3f} | "
              f"{med['transformers']:.3f} |")
    print(f"| 2, last 3 s (video_start {a.seconds - 3:g}) | {len(plan.indices)} | {t_ * h_ * w_:,} | "
          f"{statistics.median(window['ours seek']):.3f} | {statistics.median(window['ours decode all']):.3f} | "
          f"(no window) |")
    if a.reorder_samples:
        table_reorder(ckpt, clips, tmp, a)
    return 0


def table_reorder(ckpt, clips, tmp: Path, a) -> None:
    import random

    import numpy as np
    from PIL import Image

    from mimo_sft.data.image_refs import VideoRef
    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.reorder import assign
    from mimo_sft.data.video import VideoOptions

    rng = random.Random(0)
    pages = []
    for j, (w, h) in enumerate(((600, 500), (1240, 1754), (1700, 2200), (900, 1200), (2480, 1600))):
        path = tmp / f"page{j}.png"
        Image.new("RGB", (w, h), (240, 240, 240)).save(path)
        pages.append(path)
    pre = SamplePreprocessor(ckpt, seq_length=32768, video=VideoOptions(fps=a.reorder_fps))
    costs = []
    for _ in range(a.reorder_samples):
        kind = rng.choice(("clip", "clip", "window", "page", "page", "page", "text"))
        if kind == "text":
            costs.append(0.0)
            continue
        if kind == "page":
            ref = rng.choice(pages)
        else:
            clip = rng.choice(clips)
            ref = VideoRef(clip, 1.0, 1.0 + rng.uniform(1.0, a.seconds - 1.0)) if kind == "window" else VideoRef(clip)
        t, h, w = pre.image_specs([ref], 0)[0].grid
        costs.append(float(t * h * w))
    n = a.dp * a.per_rank
    before, after = [], []
    for lo in range(0, len(costs) - n + 1, n):
        c = costs[lo: lo + n]
        mean = sum(c) / a.dp
        if mean == 0:
            continue
        before.append(max(sum(c[r * a.per_rank:(r + 1) * a.per_rank]) for r in range(a.dp)) / mean)
        after.append(max(sum(c[i] for i in g) for g in assign.balanced_groups(c, a.dp)) / mean)
    print(f"\nreordering a mixed clip / page / text set: {a.reorder_samples} rows, {len(before)} windows of "
          f"{a.dp} ranks x {a.per_rank} samples, vision patches per rank")
    print("| | heaviest rank / mean (mean over windows) | worst window |")
    print("|---|---:|---:|")
    for name, v in (("dataset order", before), ("reordered", after)):
        print(f"| {name} | {np.mean(v):.3f} | {max(v):.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
