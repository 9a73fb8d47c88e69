"""Real video files for tests and the demo, written with PyAV (FFmpeg's encoders): H.264 MP4 and VP9
WebM at odd sizes, with constant or variable frame rates.

Every frame is a pattern that differs per frame (a moving bar over a colour ramp), so a wrong frame
index or a frame decoded twice changes the pixels a test compares.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import numpy as np


def frame_pattern(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i`` as ``[height, width, 3]`` uint8."""
    y, x = np.mgrid[0:height, 0:width]
    img = np.empty((height, width, 3), np.uint8)
    img[..., 0] = (x * 255 // max(1, width - 1) + 17 * i) % 256
    img[..., 1] = (y * 255 // max(1, height - 1) + 29 * i) % 256
    img[..., 2] = (40 + 37 * i) % 256
    bar = (i * 7) % max(1, width)
    img[:, bar: bar + max(2, width // 10)] = (255, 255, 255)
    return img


def write_clip(path: str | Path, *, frames: int, width: int, height: int, fps: float = 30.0,
               codec: str | None = None, variable_rate: bool = False, gop: int | None = None) -> Path:
    """Write a clip of ``frames`` frames; the container follows ``path``'s suffix (``.mp4``: H.264,
    ``.webm``: VP9). ``variable_rate`` spaces frames 1, 2, 1, 3 ... ticks apart (a VFR stream)."""
    import av

    path = Path(path)
    codec = codec or {"webm": "libvpx-vp9", "mkv": "libvpx-vp9"}.get(path.suffix.lstrip("."), "libx264")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        odd = bool(width % 2 or height % 2)
        if odd and codec != "libx264":  # VP9's 4:2:0 needs even sides
            width, height = width + (width % 2), height + (height % 2)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv444p" if odd else "yuv420p"  # H.264 takes odd sides in 4:4:4
        if gop:
            stream.codec_context.gop_size = gop  # a keyframe every ``gop`` frames: what seeking lands on
        if variable_rate:
            stream.codec_context.time_base = Fraction(1, int(round(fps)) * 4)
        pts = 0
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pattern(i, stream.width, stream.height), format="rgb24")
            if variable_rate:
                frame.pts = pts
                frame.time_base = stream.codec_context.time_base
                pts += 4 * (1, 2, 1, 3)[i % 4]
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


#: the clip mix of :func:`write_video_dataset`: (frames, width, height, fps, suffix); short and long, small and
#: wide, H.264 and VP9, one variable-rate stream
CLIP_SHAPES = ((8, 64, 48, 8.0, ".mp4"), (40, 96, 64, 20.0, ".webm"), (24, 80, 56, 12.0, ".mp4"),
               (16, 48, 40, 10.0, ".webm"), (60, 112, 64, 30.0, ".mp4"))


def write_video_dataset(out: str | os.PathLike, *, samples: int, seed: int = 0) -> Path:
    """``out/train.jsonl``: messages rows mixing clips (``{"type": "video", "video": "clips/c1.mp4"}``, some
    with a ``video_start`` / ``video_end`` window, one as a list of frame images), pages of very different
    sizes, clip+page rows and text-only rows; paths relative to the file's folder, as users write them."""
    import json
    import random

    from PIL import Image

    from mimo_sft.testing.demo_data import COLOURS, image_png

    rng = random.Random(seed)
    out = Path(out)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    clips = []
    for i, (n, w, h, fps, suffix) in enumerate(CLIP_SHAPES):
        clips.append(write_clip(out / "clips" / f"c{i}{suffix}", frames=n, width=w, height=h, fps=fps,
                                variable_rate=(i == 2)).relative_to(out).as_posix())
    frames = []
    for j in range(6):
        p = out / "clips" / f"frame{j}.png"
        Image.fromarray(frame_pattern(j, 56, 42)).save(p)
        frames.append(p.relative_to(out).as_posix())
    pages = []
    for j, (w, h) in enumerate(((60, 90), (300, 420), (90, 160), (200, 120))):
        p = out / "clips" / f"page{j}.png"
        p.write_bytes(image_png(rng, w, h, rng.choice(list(COLOURS)), j))
        pages.append(p.relative_to(out).as_posix())
    rows = []
    for i in range(samples):
        kind = ("clip", "clip", "page", "both", "text", "frames", "window")[i % 7]
        parts: list = []
        if kind in ("clip", "both"):
            parts.append({"type": "video", "video": clips[rng.randrange(len(clips))]})
        if kind == "window":
            parts.append({"type": "video", "video": clips[4], "video_start": 0.3, "video_end": 1.4})
        if kind == "frames":
            parts.append({"type": "video", "video": frames[: 2 + rng.randrange(4)]})
        if kind in ("page", "both"):
            parts.append({"type": "image", "image": pages[rng.randrange(len(pages))]})
        parts.append({"type": "text", "text": rng.choice(("What happens in the clip?", "Describe the image.",
                                                          "What colour is shown in the image?"))})
        answer = f"The number is {rng.randrange(100)} and the colour is {rng.choice(list(COLOURS))}."
        rows.append({"messages": [{"role": "user", "content": parts},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
    with open(out / "train.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return out / "train.jsonl"
