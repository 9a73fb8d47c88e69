"""Real video files for tests and the demo, written with PyAV (FFmpeg's encoders): H.264 MP4 and VP9
WebM at odd sizes, with constant or variable frame rates.

Every frame is a pattern that differs per frame (a moving bar over a colour ramp), so a wrong frame
index or a frame decoded twice changes the pixels a test compares.
"""

from __future__ import annotations

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
               codec: str | None = None, variable_rate: bool = False) -> Path:
    """Write a clip of ``frames`` frames; the container follows ``path``'s suffix (``.mp4``: H.264,
    ``.webm``: VP9). ``variable_rate`` spaces frames 1, 2, 1, 3 ... ticks apart (a VFR stream)."""
    import av

    path = Path(path)
    codec = codec or {"webm": "libvpx-vp9", "mkv": "libvpx-vp9"}.get(path.suffix.lstrip("."), "libx264")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height = width + (width % 2), height + (height % 2)  # yuv420p needs even sides
        stream.pix_fmt = "yuv420p"
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
