"""uint8 pixels end to end: the data path carries the resized image's bytes in patch order, and the
encoder's device-side normalisation (``model.pixels``) gives exactly transformers' float patches."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.model.pixels import PixelNorm, float_patches, pixel_norm_from

QWEN25_VL = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056)


def _noise(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _pre(ckpt, **kw):
    from mimo_sft.data.preprocess import SamplePreprocessor

    return SamplePreprocessor(ckpt, seq_length=256, **kw)  # the processor's own limit fits: its pixels are compared


@pytest.mark.parametrize("size", [(90, 120), (301, 77), (28, 28), (640, 480)])
def test_uint8_then_device_normalisation_equals_the_processor(tiny_ckpt, size):
    """The same image through transformers' own PIL processor (float path) and ours (uint8, then
    float_patches): equal within 1e-6 in fp32, for up- and down-scaled sizes."""
    from mimo_sft.data.processor import load_processor

    pre = _pre(tiny_ckpt)
    img = _noise(*size)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    specs = pre.image_specs([buf.getvalue()], 0)
    u8, grid = pre.pixels(specs, 0)
    ref = load_processor(tiny_ckpt).image_processor(images=[img], return_tensors="pt")
    assert u8.dtype == torch.uint8 and u8.shape == (int(grid.prod(-1).sum()), pre.pixel_dim)
    assert torch.equal(grid, ref["image_grid_thw"])
    got = float_patches(u8, pixel_norm_from(tiny_ckpt))
    assert got.dtype == torch.float32 and got.shape == ref["pixel_values"].shape
    assert torch.allclose(got, ref["pixel_values"], rtol=0, atol=1e-6)
    assert ref["pixel_values"].numel() * 4 == 8 * u8.numel()  # fp32 with the temporal tile: 8x the bytes


def test_bytes_per_image_at_real_size(tmp_path):
    """A 1414x1414 page with Qwen2.5-VL's real processor settings (patch 14, merge 2, max 12.8 Mpx):
    3 bytes per resized pixel carried, against 24 for the fp32 patches (measured, not a formula)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mimo_sft.data.preprocess import SamplePreprocessor

    ip = Qwen2VLImageProcessorPil(**QWEN25_VL)
    pre = SamplePreprocessor.__new__(SamplePreprocessor)  # only the image path: no tokenizer needed
    pre.image_processor, pre.patch_size, pre.merge_size = ip, 14, 2
    img = _noise(1414, 1414, seed=1)
    u8, grid = pre._uint8_patches(img)
    ref = ip(images=[img], return_tensors="pt")
    pixels = int(grid[1] * grid[2]) * 14 * 14
    assert u8.nbytes == 3 * pixels and ref["pixel_values"].numel() * 4 == 24 * pixels
    norm = PixelNorm(tuple(ip.image_mean), tuple(ip.image_std), float(ip.rescale_factor), 2)
    assert torch.allclose(float_patches(torch.from_numpy(u8), norm), ref["pixel_values"], rtol=0, atol=1e-6)


def test_encoder_takes_uint8_and_float_alike(tiny_ckpt):
    """Both input branches of the encoder: uint8 patches (training) and float patches (HF's)."""
    from transformers import AutoConfig

    from mimo_sft.model.qwen2_5_vl import Qwen25VisionEncoder

    torch.manual_seed(0)
    enc = Qwen25VisionEncoder(AutoConfig.from_pretrained(str(tiny_ckpt)).vision_config).eval()
    enc.pixel_norm = pixel_norm_from(tiny_ckpt)
    pre = _pre(tiny_ckpt)
    buf = io.BytesIO()
    _noise(100, 60, seed=2).save(buf, format="PNG")
    u8, grid = pre.pixels(pre.image_specs([buf.getvalue()], 0), 0)
    with torch.no_grad():
        a = enc(u8, grid)
        b = enc(float_patches(u8, enc.pixel_norm), grid)
    assert torch.equal(a, b) and a.shape[0] == int(grid.prod(-1).sum()) // 4
