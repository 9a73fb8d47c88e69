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
    print(f"\n| fps | frames | patches | ours seek (s/clip) | ours decode all (s/clip) | transformers (s/clip) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for fps, frames, patches, med in rows:
        print(f"| {fps:g} | {frames} | {patches:,} | {med['ours seek']:.3f} | {med['ours decode all']:.3f} | "
              f"{med['transformers']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
