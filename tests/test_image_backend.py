"""--image-backend: our uint8 pixels, normalised on the device, equal transformers' own image processors for
both backends (max difference 0), and 'auto' picks what AutoImageProcessor picks in this environment."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)

pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("backend")
    rng = np.random.RandomState(4)
    out = []
    for name, (w, h), mode in (("page.png", (517, 733), "RGB"), ("tiny.png", (30, 20), "RGB"),
                               ("alpha.png", (123, 77), "RGBA")):
        arr = (rng.rand(h, w, 4 if mode == "RGBA" else 3) * 255).astype("uint8")
        Image.fromarray(arr, mode).save(d / name)
        out.append(d / name)
    return out


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_pixels_equal_transformers_backend(backend, tiny_ckpt, images):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.processor import _pil_kwargs
    from mimo_sft.model.pixels import float_patches, pixel_norm_from

    pre = SamplePreprocessor(tiny_ckpt, seq_length=512, image_backend=backend)
    assert pre.image_backend == backend
    cls = Qwen2VLImageProcessor if backend == "torchvision" else Qwen2VLImageProcessorPil
    hf_proc = cls(**_pil_kwargs(pre.image_processor))
    for path in images:
        pv, grid = pre.pixels(pre.image_specs([path], 0), 0)
        ref = hf_proc(images=[Image.open(path)], return_tensors="pt")
        assert torch.equal(grid, ref["image_grid_thw"])
        ours = float_patches(pv, pixel_norm_from(tiny_ckpt, backend))
        assert float((ours - ref["pixel_values"]).abs().max()) == 0.0, (backend, path.name)
    # the two backends really differ, so each comparison means something
    other = SamplePreprocessor(tiny_ckpt, seq_length=512, image_backend="pil" if backend == "torchvision" else "torchvision")
    a = pre.pixels(pre.image_specs([images[0]], 0), 0)[0]
    b = other.pixels(other.image_specs([images[0]], 0), 0)[0]
    assert not torch.equal(a, b)


def test_auto_is_what_auto_image_processor_picks(tiny_ckpt):
    from transformers import AutoImageProcessor

    from mimo_sft.data.processor import resolve_image_backend

    picked = type(AutoImageProcessor.from_pretrained(tiny_ckpt)).__name__
    assert resolve_image_backend("auto") == ("pil" if picked.endswith("Pil") else "torchvision") == "torchvision"
