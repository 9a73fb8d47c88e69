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


def pixel_norm_from(hf_dir: str | os.PathLike) -> PixelNorm:
    """The checkpoint's normalisation; transformers' Qwen2-VL processor defaults where it says nothing."""
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
    return PixelNorm(tuple(float(v) for v in raw.get("image_mean", P.image_mean)),
                     tuple(float(v) for v in raw.get("image_std", P.image_std)),
                     float(raw.get("rescale_factor", P.rescale_factor)),
                     int(raw.get("temporal_patch_size", P.temporal_patch_size)))


def float_patches(patches: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    """uint8 ``[N, C*P*P]`` patches -> the processor's float32 ``[N, C*T*P*P]`` (on ``patches``' device)."""
    assert patches.dtype == torch.uint8 and patches.dim() == 2, (patches.dtype, tuple(patches.shape))
    c = len(norm.mean)
    n = patches.shape[0]
    x = (patches.to(torch.float64) * norm.rescale).to(torch.float32).view(n, c, 1, -1)
    mean = torch.tensor(norm.mean, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    std = torch.tensor(norm.std, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    x = (x - mean) / std
    return x.expand(n, c, norm.temporal, x.shape[-1]).reshape(n, -1)


def tower_patches(pixel_values: torch.Tensor, norm: PixelNorm | None, dtype: torch.dtype) -> torch.Tensor:
    """A vision encoder's input in the tower's ``dtype``: uint8 patches (the training data path) normalised
    with the checkpoint's ``norm`` (set by ``model.builder``), float patches (transformers') as they are."""
    if pixel_values.dtype == torch.uint8:
        assert norm is not None, "uint8 pixels need the checkpoint's pixel_norm (model.builder sets it)"
        pixel_values = float_patches(pixel_values, norm)
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
