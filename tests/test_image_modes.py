"""Every PIL mode becomes the RGB transformers' own Qwen-VL image processor makes of the same file.

Files are written by PIL in the test (grayscale, grayscale+alpha, RGBA, palette with a transparent
index, RGB with a tRNS colour, CMYK, 16-bit grayscale, EXIF-rotated, WebP with alpha, GIF with
transparency). The reference is what a user running inference does: ``Image.open`` the file, apply
its EXIF orientation, hand it to the checkpoint's image processor. Our pixel path must equal it
exactly (max difference 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)

W, H = 64, 40


def _noise(seed: int, channels: int, high: int = 256, dtype=np.uint8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (H, W) if channels == 1 else (H, W, channels)
    return rng.integers(0, high, size=shape).astype(dtype)


def _half_transparent(arr: np.ndarray) -> np.ndarray:
    """The left half fully transparent (its colour hidden), the right half a gradient of alpha."""
    arr = arr.copy()
    arr[:, : W // 2, -1] = 0
    arr[:, W // 2:, -1] = np.linspace(40, 255, W - W // 2).astype(np.uint8)
    return arr


def _write_all(folder) -> dict[str, str]:
    files = {}

    def save(name, img, **kw):
        path = str(folder / name)
        img.save(path, **kw)
        files[name] = path

    save("gray.png", Image.fromarray(_noise(1, 1), "L"))
    save("gray_alpha.png", Image.fromarray(_half_transparent(_noise(2, 2)), "LA"))
    save("rgba.png", Image.fromarray(_half_transparent(_noise(3, 4)), "RGBA"))
    pal = Image.frombytes("P", (W, H), _noise(4, 1, high=16).tobytes())  # indices 0..15, index 3 transparent
    pal.putpalette([v for i in range(16) for v in (i * 16, 255 - i * 16, (i * 77) % 256)])
    save("palette_transparent.png", pal, transparency=3)
    save("rgb_trns.png", Image.fromarray(_noise(5, 3, high=2) * 255, "RGB"), transparency=(255, 0, 255))
    save("cmyk.jpg", Image.fromarray(_noise(6, 4), "CMYK"), quality=95)
    save("gray16.png", Image.fromarray(_noise(7, 1, high=65535, dtype=np.uint16)))  # mode I;16
    rotated = Image.fromarray(_noise(8, 3), "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated by 90 degrees
    save("exif_rotated.jpg", rotated, exif=exif.tobytes())
    save("rgba.webp", Image.fromarray(_half_transparent(_noise(9, 4)), "RGBA"), lossless=True)
    save("transparent.gif", pal, transparency=3)
    return files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _write_all(tmp_path_factory.mktemp("modes"))


@pytest.fixture(scope="module")
def pre(tiny_ckpt):
    from mimo_sft.data.preprocess import SamplePreprocessor

    return SamplePreprocessor(tiny_ckpt, seq_length=512)


def _reference(tiny_ckpt, path: str) -> torch.Tensor:
    from mimo_sft.data.processor import load_processor

    upright = ImageOps.exif_transpose(Image.open(path))
    out = load_processor(tiny_ckpt).image_processor(images=[upright], return_tensors="pt")
    return out["pixel_values"]


def _processor_uint8(ref: torch.Tensor, tiny_ckpt) -> torch.Tensor:
    """The processor's float patches ``[N, C*T*P*P]`` back to the 8-bit values they were made from,
    ``[N, C*P*P]`` (first temporal copy): what the data path carries (uint8) is compared exactly."""
    from mimo_sft.model.pixels import pixel_norm_from

    norm = pixel_norm_from(tiny_ckpt)
    c = len(norm.mean)
    x = ref.double().view(ref.shape[0], c, norm.temporal, -1)[:, :, 0]
    mean = torch.tensor(norm.mean, dtype=torch.float64).view(1, c, 1)
    std = torch.tensor(norm.std, dtype=torch.float64).view(1, c, 1)
    values = (x * std + mean) / norm.rescale
    assert float((values - values.round()).abs().max()) < 1e-3  # float rounding only, far from a half step
    return values.round().to(torch.uint8).reshape(ref.shape[0], -1)


def test_files_have_the_modes_they_claim(files):
    modes = {name: Image.open(path).mode for name, path in files.items()}
    assert modes["gray.png"] == "L" and modes["gray_alpha.png"] == "LA" and modes["rgba.png"] == "RGBA"
    assert modes["palette_transparent.png"] == "P" and "transparency" in Image.open(files["palette_transparent.png"]).info
    assert modes["rgb_trns.png"] == "RGB" and "transparency" in Image.open(files["rgb_trns.png"]).info
    assert modes["cmyk.jpg"] == "CMYK" and modes["gray16.png"].startswith("I")
    assert Image.open(files["exif_rotated.jpg"]).getexif().get(0x0112) == 6
    assert modes["rgba.webp"] == "RGBA" and modes["transparent.gif"] == "P"


def test_every_mode_equals_transformers_processor(files, pre, tiny_ckpt):
    from pathlib import Path

    for i, (name, path) in enumerate(sorted(files.items())):
        ours, _grid = pre.pixels(pre.image_specs([Path(path)], i), i)
        ref = _processor_uint8(_reference(tiny_ckpt, path), tiny_ckpt)
        assert ours.dtype == torch.uint8 and ours.shape == ref.shape, name
        assert int((ours.int() - ref.int()).abs().max()) == 0, name


def test_transparency_is_composited_onto_white_not_dropped(files, pre, tiny_ckpt):
    """The check above could pass with a converter that drops alpha only if transformers did too:
    show it does not (a plain convert("RGB") differs), so the equality above is about compositing."""
    from pathlib import Path

    for name in ("rgba.png", "gray_alpha.png", "palette_transparent.png", "rgba.webp"):
        ours, _ = pre.pixels(pre.image_specs([Path(files[name])], 0), 0)
        # (through numpy: PIL's convert keeps a palette's transparent colour in info, which transformers honours)
        plain = Image.fromarray(np.asarray(Image.open(files[name]).convert("RGB")))
        dropped = _processor_uint8(pre.image_processor(images=[plain], return_tensors="pt")["pixel_values"], tiny_ckpt)
        assert int((ours.int() - dropped.int()).abs().max()) > 10, name
