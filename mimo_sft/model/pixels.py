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
