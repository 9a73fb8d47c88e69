"""Video clips: read a clip's header, pick its frames as the family's transformers video processor does,
decode only those frames, and cut them into uint8 patches.

Why it is written this way:

* **One rule for the frames, two paths.** Language-only ranks must compute a clip's grid (and so its
  tokens and positions) without decoding a frame, and vision ranks must decode exactly the frames that
  grid counts. Both go through :meth:`ClipReader.plan`, which reads only the container header
  (frame count, frame rate, size) and asks the family's transformers video processor
  (``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``) for ``sample_frames`` and for the size its
  ``resize`` would choose. The pixel path then decodes the planned indices and asserts the grid.
* **A container's frame count is not trusted blindly.** FFmpeg's VP9 WebM reports 0 frames (transformers
  5.23's ``read_video_pyav`` then fails with IndexError). Where the stream does not say, the frames are
  counted from the demuxed packets (no decoding); where it has no frame rate, 24 fps is assumed, as the
  Qwen3-VL processor assumes, and the plan says so (``ClipPlan.fps_assumed``).
* **Decode what is used.** Frames are decoded in order up to the last planned index and only planned
  frames are converted to RGB; a long gap before the next planned frame is crossed with a keyframe seek
  when the stream has a constant frame rate (``scripts/bench_video.py`` measures both).
* **Pixels as the processor makes them.** The planned frames go through the processor's own resize
  (torchvision, on uint8), then are cut in its patch order and kept uint8: ``[t*T*h*w, C*P*P]``, the T
  frames of each temporal patch as T consecutive rows. ``model.pixels`` regroups them on the device and
  applies the processor's fused rescale-and-normalise (``tests/test_video.py`` compares with transformers).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mimo_sft.data.image_refs import VideoRef
from mimo_sft.errors import BadSampleError, UserError

#: what the Qwen3-VL processor assumes for a clip whose stream has no frame rate
ASSUMED_FPS = 24.0


@dataclass(frozen=True)
class VideoOptions:
    """The flags under ``data`` that change which frames and pixels a clip gives (None: the processor's)."""

    fps: float = 2.0
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    cap_pixels_per_frame: bool = False


@dataclass
class ClipPlan:
    """What both paths need per clip: the planned frames and the grid they make."""

    ref: VideoRef
    grid: tuple[int, int, int]          # (t, h, w) in patches, as the model sees it
    indices: list[int]                  # planned frame indices (absolute, in decode order)
    fps: float                          # the stream's frame rate (or the assumed / given one)
    window_frames: int                  # frames in the sampled window
    size: tuple[int, int]               # (height, width) of the decoded frames
    resized: tuple[int, int]            # (height, width) after the processor's resize
    fps_assumed: bool = False
    downsampled: bool = False           # fewer frames or pixels than the options give, to fit --seq-length
    timestamps: list[float] = field(default_factory=list)  # seconds per temporal patch (Qwen3-VL text)

    @property
    def sampled_fps(self) -> float:
        """transformers' ``VideoMetadata.sampled_fps`` of the window (Qwen2.5-VL's ``second_per_grid_ts``)."""
        return len(self.indices) / self.window_frames * self.fps

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


# --------------------------------------------------------------------------- headers and frames

@dataclass(frozen=True)
class ClipHeader:
    frames: int
    fps: float
    height: int
    width: int
    fps_assumed: bool = False


def _open(ref: VideoRef):
    import av

    src = ref.source
    if isinstance(src, (bytes, bytearray)):
        import io

        src = io.BytesIO(bytes(src))
    return av.open(src if not isinstance(src, Path) else str(src))


def _bad(idx: int, ref: VideoRef, why: str, stage: str | None = None) -> BadSampleError:
    err = BadSampleError(idx, ref.where(), why)
    if stage:
        err.stage = stage
    return err


def read_header(ref: VideoRef, idx: int) -> ClipHeader:
    """The clip's frame count, rate and size from its container (frames counted from packets where the
    stream does not say); a missing, truncated or non-video file is a ``BadSampleError``."""
    if ref.is_frames:
        from mimo_sft.data.images import open_sample_image

        if not ref.source:
            raise _bad(idx, ref, "the video's frame list is empty")
        sizes = {open_sample_image(f, idx).size for f in ref.source}
        if len(sizes) != 1:
            raise _bad(idx, ref, f"the video's frames have {len(sizes)} different sizes; give frames of one size")
        (w, h), = sizes
        return ClipHeader(len(ref.source), float(ref.fps), h, w)
    if isinstance(ref.source, Path) and not ref.source.is_file():
        raise _bad(idx, ref, "video file not found; check the path or set --image-root")
    try:
        container = _open(ref)
    except Exception as err:  # PyAV raises its own error types for every way a file is not a clip
        raise _bad(idx, ref, f"cannot open as a video ({type(err).__name__}: {str(err).strip()[:120]})") from None
    try:
        if not container.streams.video:
            raise _bad(idx, ref, "the file has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps, assumed = (float(rate), False) if rate else (ASSUMED_FPS, True)
        frames = int(stream.frames or 0)
        if frames <= 0:  # WebM and some streams do not say: count packets (no decoding)
            frames = sum(1 for packet in container.demux(stream) if packet.size > 0)
        if frames <= 0 or not stream.width or not stream.height:
            raise _bad(idx, ref, "the video stream has no frames")
        return ClipHeader(frames, fps, int(stream.height), int(stream.width), assumed)
    except BadSampleError:
        raise
    except Exception as err:
        raise _bad(idx, ref, f"cannot read the video ({type(err).__name__}: {str(err).strip()[:120]})") from None
    finally:
        container.close()


#: frames between two planned ones past which a constant-rate stream is sought rather than decoded through
SEEK_GAP = 24


@dataclass(frozen=True)
class _FrameClock:
    """Frame index <-> timestamp of a constant-rate stream (where decode order and time agree)."""

    start: int
    ticks_per_frame: float

    def pts_of(self, index: int) -> int:
        return int(self.start + index * self.ticks_per_frame)

    def index_of(self, pts) -> int:
        return int(round((pts - self.start) / self.ticks_per_frame))


def _frame_clock(stream) -> _FrameClock | None:
    """The stream's clock when its frames are evenly spaced (its average rate is its base rate) and stamped;
    None otherwise (a variable-rate stream is decoded in order, never sought)."""
    avg, base, tb = stream.average_rate, stream.base_rate, stream.time_base
    if not avg or not base or not tb or avg != base:
        return None
    return _FrameClock(int(stream.start_time or 0), float(1 / (avg * tb)))


def decode_frames(ref: VideoRef, indices: list[int], idx: int, *, seek: bool = True) -> np.ndarray:
    """The frames at ``indices`` (sorted, repeats allowed) as ``[n, H, W, 3]`` uint8 RGB, in decode order
    as transformers counts them. Only those frames are converted to RGB; with ``seek``, a constant-rate
    stream jumps over gaps of more than :data:`SEEK_GAP` frames (``tests/test_video.py``: the same frames as
    decoding every one). A clip that ends before the last index is a ``BadSampleError`` at the pixel stage
    (the loader keeps the planned text and blanks the pixels)."""
    if ref.is_frames:
        from mimo_sft.data.images import open_sample_image, to_rgb

        return np.stack([np.asarray(to_rgb(open_sample_image(ref.source[i], idx))) for i in indices])
    wanted = sorted(set(int(i) for i in indices))
    got: dict[int, np.ndarray] = {}
    try:
        container = _open(ref)
    except Exception as err:
        raise _bad(idx, ref, f"cannot open as a video ({type(err).__name__})", "pixels") from None
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        at = _frame_clock(stream) if seek else None
        pos = 0  # decode-order index of the next frame the decoder gives
        frames_iter = container.decode(stream)
        for target in wanted:
            if at is not None and target - pos > SEEK_GAP:  # a keyframe seek, then decode up to the frame
                container.seek(at.pts_of(target), stream=stream, backward=True)
                frames_iter, pos = container.decode(stream), None
            for frame in frames_iter:
                i = pos if pos is not None else at.index_of(frame.pts)
                pos = i + 1
                if i == target:
                    got[i] = frame.to_ndarray(format="rgb24")
                    break
            else:
                break
    except Exception as err:
        raise _bad(idx, ref, f"cannot decode the video ({type(err).__name__}: {str(err).strip()[:120]})",
                   "pixels") from None
    finally:
        container.close()
    missing = [i for i in wanted if i not in got]
    if missing:
        raise _bad(idx, ref, f"the video ends before frame {missing[0]} (its header promised more frames); "
                   "re-encode or remove the clip", "pixels")
    return np.stack([got[int(i)] for i in indices])


# --------------------------------------------------------------------------- the family's processor

def video_processor_for(model_dir: str | os.PathLike, model_type: str | None):
    """transformers' video processor of the checkpoint: from its ``video_preprocessor_config.json`` when it
    has one, else the family's class with its own defaults. Needs torchvision (transformers does)."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise UserError("video rows need torchvision (transformers' video processors use it): install the "
                        "torchvision release paired with your torch (make install does), or remove the video rows")
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES
    import transformers

    names = VIDEO_PROCESSOR_MAPPING_NAMES.get(model_type or "qwen2_5_vl") or VIDEO_PROCESSOR_MAPPING_NAMES["qwen2_5_vl"]
    cls = getattr(transformers, names["torchvision"] if isinstance(names, dict) else names)
    config = Path(model_dir) / "video_preprocessor_config.json"
    return cls.from_pretrained(str(model_dir)) if config.is_file() else cls()


class ClipReader:
    """Plans and decodes one family's clips with ``options``; picklable (loader workers get a copy)."""

    def __init__(self, model_dir, model_type, options: VideoOptions, *, timestamps: bool):
        self.model_dir, self.model_type, self.options, self.timestamps = str(model_dir), model_type, options, timestamps
        vp = video_processor_for(model_dir, model_type)
        size = dict(vp.size)
        if options.min_pixels is not None:
            size["shortest_edge"] = int(options.min_pixels)
        if options.max_pixels is not None:
            size["longest_edge"] = int(options.max_pixels)
        if size["shortest_edge"] > size["longest_edge"]:
            raise UserError(f"--video-min-pixels {size['shortest_edge']} is larger than --video-max-pixels "
                            f"{size['longest_edge']}; lower one of them")
        self.min_pixels, self.max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        self.min_frames = int(options.min_frames if options.min_frames is not None else vp.min_frames)
        self.max_frames = int(options.max_frames if options.max_frames is not None else vp.max_frames)
        if self.min_frames > self.max_frames:
            raise UserError(f"--video-min-frames {self.min_frames} is larger than --video-max-frames {self.max_frames}")
        self.patch, self.merge, self.temporal = int(vp.patch_size), int(vp.merge_size), int(vp.temporal_patch_size)
        self.fps = float(options.fps)
        self.cap = bool(options.cap_pixels_per_frame)
        self.max_video_tokens = int(getattr(vp, "max_video_tokens", 128000))
        self._vp = self._configured(vp)  # the one read above, with this run's settings (workers build their own)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_vp"} | {"_vp": None}

    @property
    def vp(self):
        """The transformers video processor with this run's frame and pixel settings (built lazily: workers)."""
        if self._vp is None:
            self._vp = self._configured(video_processor_for(self.model_dir, self.model_type))
        return self._vp

    def _configured(self, vp):
        """``vp`` with this run's frame and pixel settings."""
        vp.size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        vp.min_frames, vp.max_frames, vp.fps = self.min_frames, self.max_frames, self.fps
        return vp

    # ------------------------------------------------------------------ planning (headers only)

    def window(self, ref: VideoRef, header: ClipHeader, idx: int) -> tuple[int, int]:
        """[first, end) frames of ``video_start`` / ``video_end`` (the whole clip without them)."""
        start = 0 if ref.start is None else int(round(float(ref.start) * header.fps))
        end = header.frames if ref.end is None else min(header.frames, int(round(float(ref.end) * header.fps)))
        if ref.start is not None and ref.end is not None and float(ref.start) >= float(ref.end):
            raise _bad(idx, ref, f"video_start {ref.start} is not before video_end {ref.end}; fix the row")
        if start >= end:
            raise _bad(idx, ref, f"the window [{ref.start}, {ref.end}] s holds no frame of this "
                       f"{header.frames / header.fps:.2f} s clip; fix video_start / video_end")
        return start, end

    def sample(self, header: ClipHeader, first: int, end: int, num_frames: int | None = None) -> list[int]:
        """The processor's ``sample_frames`` over the window, as absolute indices. A frame list is used
        whole (its frames are already sampled)."""
        from transformers.video_utils import VideoMetadata

        n = end - first
        meta = VideoMetadata(total_num_frames=n, fps=header.fps, width=header.width, height=header.height,
                             duration=n / header.fps)
        kwargs = {"num_frames": num_frames} if num_frames is not None else {"fps": self.fps}
        try:
            rel = self.vp.sample_frames(meta, **kwargs)
        except ValueError as err:
            raise UserError(str(err)) from None
        return [first + int(i) for i in (rel.tolist() if hasattr(rel, "tolist") else rel)]

    def resized(self, frames: int, height: int, width: int, max_pixels: int) -> tuple[int, int]:
        """(height, width) the processor's ``resize`` gives ``frames`` frames of ``height x width``."""
        factor = self.patch * self.merge
        if self.timestamps:  # Qwen3-VL's resize: the pixel budget is the whole clip's
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

            if self.cap:
                per = max(min(self.max_video_tokens * factor * factor, max_pixels // frames), int(self.min_pixels * 1.05))
                max_pixels = per * frames
            return smart_resize(frames, height, width, temporal_factor=self.temporal, factor=factor,
                                min_pixels=self.min_pixels, max_pixels=max_pixels)
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

        if self.cap:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal // frames), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)

    def plan(self, ref: VideoRef, idx: int, *, token_budget: int | None = None) -> ClipPlan:
        """The clip's frames and grid from its header. With ``token_budget``, a clip whose tokens exceed it
        samples fewer frames (down to ``--video-min-frames``), then smaller frames (down to
        ``--video-min-pixels``); one that still does not fit is a ``BadSampleError``."""
        if ref.is_frames and ref.fps is None:
            ref = VideoRef(ref.source, ref.start, ref.end, self.fps)
        header = read_header(ref, idx)
        first, end = self.window(ref, header, idx)
        if end - first < self.temporal:
            raise _bad(idx, ref, f"the clip has {end - first} frame(s) in its window, fewer than one temporal patch "
                       f"({self.temporal} frames); use a longer clip or window")
        if ref.is_frames:
            indices = list(range(first, end))
        else:
            try:
                indices = self.sample(header, first, end)
            except UserError as err:
                raise _bad(idx, ref, str(err)) from None
        plan = self._plan(ref, header, first, end, indices, self.max_pixels, idx)
        if self.options.total_pixels:  # --video-total-pixels: frames x resized area, as tokens
            pixel_budget = int(self.options.total_pixels) // (self.temporal * (self.patch * self.merge) ** 2)
            token_budget = pixel_budget if token_budget is None else min(token_budget, pixel_budget)
        if token_budget is None or plan.tokens(self.merge) <= token_budget:
            return plan
        # fewer frames first: each step drops one temporal patch
        n = len(indices)
        while n > max(self.min_frames, self.temporal) and plan.tokens(self.merge) > token_budget:
            n -= self.temporal
            plan = self._plan(ref, header, first, end, self.sample(header, first, end, n), self.max_pixels, idx)
        max_pixels = self.max_pixels
        while plan.tokens(self.merge) > token_budget and max_pixels > self.min_pixels:
            max_pixels = max(self.min_pixels, int(max_pixels * 0.8))
            plan = self._plan(ref, header, first, end, plan.indices, max_pixels, idx)
        if plan.tokens(self.merge) > token_budget:
            raise _bad(idx, ref, f"the clip needs {plan.tokens(self.merge)} tokens even at {len(plan.indices)} frames "
                       f"and --video-min-pixels {self.min_pixels}, more than the {token_budget} --seq-length leaves; "
                       "shorten the clip (video_start / video_end), raise --seq-length or lower --video-min-pixels")
        plan.downsampled = True
        return plan

    def _plan(self, ref, header, first, end, indices, max_pixels, idx) -> ClipPlan:
        n = len(indices)
        if n == 0:
            raise _bad(idx, ref, "no frame was sampled from the clip")
        if n < self.temporal:
            raise _bad(idx, ref, f"the clip gives {n} frame(s), fewer than one temporal patch ({self.temporal} "
                       "frames); use a longer clip or window")
        try:
            rh, rw = self.resized(n, header.height, header.width, max_pixels)
        except ValueError as err:
            raise _bad(idx, ref, f"frames of {header.width}x{header.height} cannot be used ({err})") from None
        t = math.ceil(n / self.temporal)
        plan = ClipPlan(ref, (t, rh // self.patch, rw // self.patch), list(indices), header.fps, end - first,
                        (header.height, header.width), (rh, rw), header.fps_assumed)
        if self.timestamps:
            from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

            plan.timestamps = list(Qwen3VLProcessor._calculate_timestamps(None, list(indices), header.fps, self.temporal))
        return plan

    # ------------------------------------------------------------------ pixels

    def pixels(self, plan: ClipPlan, idx: int, *, seek: bool = True) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Decode the planned frames; resize as the processor does; ``[t*T*h*w, C*P*P]`` uint8 rows and the
        pixel grid ``(t*T, h, w)`` (``model.pixels``: a grid with more than one frame row is a clip)."""
        import torch
        from transformers.image_utils import SizeDict

        frames = decode_frames(plan.ref, plan.indices, idx, seek=seek)
        if frames.shape[1:3] != plan.size:
            raise _bad(idx, plan.ref, f"decoded frames are {frames.shape[2]}x{frames.shape[1]}, the header said "
                       f"{plan.size[1]}x{plan.size[0]}", "pixels")
        video = torch.from_numpy(frames).permute(0, 3, 1, 2).unsqueeze(0).contiguous()  # (1, n, C, H, W)
        vp = self.vp
        resized = vp.resize(video, size=SizeDict(**vp.size), resample=vp.resample, factor=self.patch * self.merge,
                            temporal_factor=self.temporal, cap_pixels_per_frame=self.cap)
        assert tuple(resized.shape[-2:]) == plan.resized, (tuple(resized.shape[-2:]), plan.resized)
        assert resized.dtype == torch.uint8, resized.dtype
        return uint8_clip_patches(resized[0], self.patch, self.merge, self.temporal), \
            (plan.grid[0] * self.temporal, plan.grid[1], plan.grid[2])


def uint8_clip_patches(video, patch: int, merge: int, temporal: int) -> np.ndarray:
    """``(n, C, H, W)`` uint8 frames -> rows ``[t*T*gh*gw, C*P*P]``: the processor's ``patchify`` order
    (the last frame repeated up to a whole temporal patch), each patch's T frames as T consecutive rows."""
    import torch

    n, c, h, w = video.shape
    if pad := -n % temporal:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)], 0)
        n += pad
    gt, gh, gw = n // temporal, h // patch, w // patch
    x = video.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 1, 2, 5, 8)  # (t, gh/m, gw/m, m, m, T, C, P, P)
    return np.ascontiguousarray(x.numpy()).reshape(gt * gh * gw * temporal, c * patch * patch)
