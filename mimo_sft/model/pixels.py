"""Pixels arrive as uint8 patches; the encoder turns them into the processor's float patches.

Why: the data path (DataLoader workers, shared memory, the reorder exchange, the host-to-device
copy) used to carry transformers' float patches, ``C*T*P*P`` fp32 values per patch: 24 bytes per
image pixel (the temporal tile doubles a still image). It now carries the resized image's own bytes
in patch order, ``C*P*P`` uint8 values per patch: 3 bytes per pixel, 8x fewer. Rescaling,
normalisation and the temporal tile -- the rest of transformers' ``Qwen2VLImageProcessorPil``
after its resize -- run here, on the device, with the same arithmetic as transformers'
``rescale`` (float64 product, then float32) and ``normalize`` (float32), so the encoder's input is
the processor's float path (``tests/test_uint8_pixels.py`` checks it against transformers).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch


class PixelNorm(NamedTuple):
    """What the processor does after resizing, per checkpoint (``preprocessor_config.json``)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float
    temporal: int
    #: the video processor's (``video_preprocessor_config.json``; the image processor's where it has none)
    video_mean: tuple[float, ...] | None = None
    video_std: tuple[float, ...] | None = None
    video_rescale: float | None = None
    #: images' arithmetic: transformers' torchvision backend (fused rescale-and-normalise) rather than the PIL one's
    image_fused: bool = False


def pixel_norm_from(hf_dir: str | os.PathLike, image_backend: str = "pil") -> PixelNorm:
    """The checkpoint's normalisation; transformers' Qwen2-VL processor defaults where it says nothing.
    ``image_backend``: the data path's (``data.processor.resolve_image_backend``), whose arithmetic images get."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as P

    path = os.path.join(str(hf_dir), "preprocessor_config.json")
    nested = os.path.join(str(hf_dir), "processor_config.json")  # transformers 5 writes the image processor here
    raw = {}
    if os.path.isfile(path):
        with open(path) as fh:
            raw = json.load(fh)
    elif os.path.isfile(nested):
        with open(nested) as fh:
            raw = json.load(fh).get("image_processor") or {}
    mean = tuple(float(v) for v in raw.get("image_mean", P.image_mean))
    std = tuple(float(v) for v in raw.get("image_std", P.image_std))
    rescale = float(raw.get("rescale_factor", P.rescale_factor))
    video = os.path.join(str(hf_dir), "video_preprocessor_config.json")
    vraw = {}
    if os.path.isfile(video):
        with open(video) as fh:
            vraw = json.load(fh)
    return PixelNorm(mean, std, rescale, int(raw.get("temporal_patch_size", P.temporal_patch_size)),
                     tuple(float(v) for v in vraw.get("image_mean", mean)),
                     tuple(float(v) for v in vraw.get("image_std", std)),
                     float(vraw.get("rescale_factor", rescale)), image_backend == "torchvision")


def model_grid_thw(grid_thw: torch.Tensor, temporal: int) -> torch.Tensor:
    """The model's ``(t, h, w)`` of each vision item from the pixel grid the data path carries: an image
    has one frame row (``t == 1``); a clip carries its ``temporal`` frames per patch as rows, so its pixel
    grid's first side is ``t * temporal`` (``data.video``)."""
    if grid_thw.shape[0] == 0 or max(grid_thw[:, 0].tolist()) <= 1:  # the host grid: no device read
        return grid_thw
    out = grid_thw.clone()
    clip = out[:, 0] > 1
    out[clip, 0] = out[clip, 0] // temporal
    return out


_CONSTANTS: dict = {}


def _constant(values: tuple, scale: float, device: torch.device) -> torch.Tensor:
    """``values * scale`` as a float32 tensor on ``device``, made once per device and values: a per-micro-batch
    ``torch.tensor(..., device=...)`` would be a copy from pageable host memory every time (a sync on a GPU)."""
    key = (values, scale, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = (torch.tensor(values, dtype=torch.float32) * scale).to(device)
    return _CONSTANTS[key]


def _clip_float_patches(rows: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    """A clip's uint8 rows ``[n*T, C*P*P]`` -> ``[n, C*T*P*P]`` in the processor's patch order, with
    transformers' torchvision backend arithmetic: its fused rescale-and-normalise (mean and std divided by
    the rescale factor in float32, then ``(x - mean) / std``)."""
    c, t = len(norm.video_mean or norm.mean), norm.temporal
    n = rows.shape[0] // t
    x = rows.view(n, t, c, -1).permute(0, 2, 1, 3).to(torch.float32)
    rescale = norm.video_rescale if norm.video_rescale is not None else norm.rescale
    mean = _constant(tuple(norm.video_mean or norm.mean), 1.0 / rescale, x.device)
    std = _constant(tuple(norm.video_std or norm.std), 1.0 / rescale, x.device)
    return ((x - mean.view(1, c, 1, 1)) / std.view(1, c, 1, 1)).reshape(n, -1)


def float_patches(patches: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    """uint8 ``[N, C*P*P]`` patches -> the processor's float32 ``[N, C*T*P*P]`` (on ``patches``' device), with
    the PIL backend's arithmetic (float64 rescale, then float32 normalise) or, ``norm.image_fused``, the
    torchvision backend's (mean and std divided by the rescale factor, one float32 normalise)."""
    assert patches.dtype == torch.uint8 and patches.dim() == 2, (patches.dtype, tuple(patches.shape))
    c = len(norm.mean)
    n = patches.shape[0]
    if norm.image_fused:
        x = patches.to(torch.float32).view(n, c, 1, -1)
        mean = _constant(tuple(norm.mean), 1.0 / norm.rescale, x.device).view(1, c, 1, 1)
        std = _constant(tuple(norm.std), 1.0 / norm.rescale, x.device).view(1, c, 1, 1)
    else:
        x = (patches.to(torch.float64) * norm.rescale).to(torch.float32).view(n, c, 1, -1)
        mean = _constant(tuple(norm.mean), 1.0, x.device).view(1, c, 1, 1)
        std = _constant(tuple(norm.std), 1.0, x.device).view(1, c, 1, 1)
    x = (x - mean) / std
    return x.expand(n, c, norm.temporal, x.shape[-1]).reshape(n, -1)


def tower_patches(pixel_values: torch.Tensor, norm: PixelNorm | None, dtype: torch.dtype,
                  grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """A vision encoder's input in the tower's ``dtype``: uint8 patches (the training data path) normalised
    with the checkpoint's ``norm`` (set by ``model.builder``), float patches (transformers') as they are.
    ``grid_thw`` is the carried pixel grid (host): with clips in it, each item is converted by its kind."""
    if pixel_values.dtype == torch.uint8:
        assert norm is not None, "uint8 pixels need the checkpoint's pixel_norm (model.builder sets it)"
        if grid_thw is None or grid_thw.shape[0] == 0 or max(grid_thw[:, 0].tolist()) <= 1:
            pixel_values = float_patches(pixel_values, norm)
        else:
            parts, at = [], 0
            for t, h, w in grid_thw.tolist():
                rows = pixel_values[at: at + t * h * w]
                at += t * h * w
                parts.append(_clip_float_patches(rows, norm) if t > 1 else float_patches(rows, norm))
            pixel_values = torch.cat(parts, 0)
    return pixel_values.to(dtype)


def no_image_rows(encoder: torch.nn.Module, like: torch.Tensor, width: int) -> torch.Tensor:
    """An encoder's output for zero images: ``[0, width]`` in ``like``'s dtype, connected to every trainable
    parameter, so it requires grad exactly when an output with images would and its (zero) gradient reaches
    them (a colocated bridge's gather group needs every rank's encoder output: ``train.bridge``)."""
    out = like.new_zeros((0, width))
    trainable = [p for p in encoder.parameters() if p.requires_grad]
    if trainable:
        out = out + torch.stack([p.reshape(-1)[:0].sum() for p in trainable]).sum().to(out.dtype)
    return out


def tower_input(pixel_values: torch.Tensor, grid_thw: torch.Tensor, norm: PixelNorm | None, dtype: torch.dtype,
                temporal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float patches, the model's grid)`` of an encoder's input: uint8 rows with their carried pixel grid
    (:func:`model_grid_thw`), or transformers' float patches with the model's grid as they are."""
    if pixel_values.dtype != torch.uint8:
        return pixel_values.to(dtype), grid_thw
    return tower_patches(pixel_values, norm, dtype, grid_thw), model_grid_thw(grid_thw, temporal)
