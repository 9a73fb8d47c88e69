"""Opening one sample's image with errors that name it, and its RGB exactly as transformers makes it.

``open_sample_image``: PIL's decompression-bomb guard raises a bare ``DecompressionBombError`` from
``Image.open`` for any image above 2 x ``Image.MAX_IMAGE_PIXELS`` (about 179 megapixels); mimo-sft
applies the same limit itself, from the header, as ``--max-image-pixels`` (0: none), so an oversized
file is one line naming its sample and path, and a trusted one can be allowed (it is resized to
``--max-pixels`` anyway). A folder where an image file should be is said to be a folder.

``to_rgb``: the model must train on the pixels inference will show it. ``Image.convert("RGB")`` drops
alpha and keeps whatever colour hides under transparent pixels; transformers' processor
(``image_transforms.convert_to_rgb``, which ``Qwen2VLImageProcessorPil`` applies to every PIL
input) composites any image with an alpha band or a ``transparency`` entry (LA, RGBA, PA, P or L
with a transparent index) onto white and converts every other mode with PIL's own ``convert``. So
this calls that same function rather than re-implementing it; ``tests/test_image_modes.py``
compares the result with transformers' processor on files PIL writes in every odd mode.

Consequences worth knowing (they are transformers' behaviour, kept on purpose): 16-bit grayscale
(``I;16``, ``I``) is clipped to 0..255 by PIL's conversion, so a typical 16-bit PNG becomes almost
white; CMYK uses PIL's naive CMYK -> RGB conversion (no colour profile).
"""

from __future__ import annotations

from pathlib import Path

from mimo_sft.errors import BadSampleError

#: what PIL itself refuses (``Image.open`` raises above twice its MAX_IMAGE_PIXELS); the --max-image-pixels default
PIL_BOMB_LIMIT = 2 * 89_478_485


def image_where(ref) -> str | None:
    """The file an image reference names, for messages (None for in-dataset bytes or an in-memory image)."""
    return str(ref) if isinstance(ref, (str, Path)) else None


def open_sample_image(ref, idx: int, *, max_image_pixels: int | None = PIL_BOMB_LIMIT):
    """Sample ``idx``'s image, header parsed and pixels not decoded, refused with a ``BadSampleError``
    when it is a folder or larger than ``max_image_pixels`` (None or 0: no limit)."""
    from PIL import Image

    from mimo_sft.data.sources import open_image_header

    if isinstance(ref, Path) and not ref.is_file():
        if ref.is_dir():
            raise BadSampleError(idx, str(ref), "is a folder, not an image file; point the sample at the image inside it")
        raise BadSampleError(idx, str(ref), "image file not found; check the path or set --image-root")
    Image.MAX_IMAGE_PIXELS = None  # the limit below replaces PIL's, which raises without naming the file
    img = open_image_header(ref, idx)
    w, h = img.size
    if max_image_pixels and w * h > max_image_pixels:
        raise BadSampleError(idx, image_where(ref), f"image is {w}x{h} = {w * h:,} pixels, above --max-image-pixels "
                             f"{max_image_pixels:,} (PIL's decompression-bomb limit by default); if the file is "
                             f"trusted, raise --max-image-pixels (0: no limit; it is resized to --max-pixels anyway)")
    return img


def to_rgb(img):
    """``img`` (any PIL mode, already oriented) as a PIL RGB image, as transformers' processor sees it."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    if img.mode == "RGB" and img.info.get("transparency") is None:  # nothing to convert (a tRNS colour is)
        return img
    return Image.fromarray(convert_to_rgb(img, return_numpy=True))


_SWAP_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that rotate by 90 degrees


def _transpose_table():
    from PIL import Image

    T = Image.Transpose  # the same table PIL's ImageOps.exif_transpose (and datasets) applies
    return {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM, 5: T.TRANSPOSE, 6: T.ROTATE_270,
            7: T.TRANSVERSE, 8: T.ROTATE_90}


_TRANSPOSE = _transpose_table()


def header_orientation(img) -> int | None:
    """EXIF orientation readable without decoding pixels.

    JPEG/WebP/TIFF parse EXIF at open; PNG's ``getexif()`` would decode the image to look for an eXIf
    chunk after the pixel data, so for PNG only an eXIf chunk before the pixels counts (both paths
    use this same value, so they always agree).
    """
    try:
        if img.format == "PNG":
            raw = img.info.get("exif")
            if not raw:
                return None
            from PIL import Image

            exif = Image.Exif()
            exif.load(raw)
            return exif.get(0x0112)
        return img.getexif().get(0x0112)
    except Exception:  # a broken EXIF block must not stop training (datasets ignores it too)
        return None


def decode_rgb(ref, idx: int, *, orientation: int | None, max_image_pixels: int | None = PIL_BOMB_LIMIT):
    """Sample ``idx``'s image as the model sees it: decoded, turned by its header's EXIF ``orientation``
    (:func:`header_orientation`, as the grid was), RGB with transparency composited onto white as
    transformers does. Pixels that cannot be decoded are a ``BadSampleError`` of stage ``pixels``."""
    img = open_sample_image(ref, idx, max_image_pixels=max_image_pixels)
    try:
        img.load()
        if orientation in _TRANSPOSE:
            img = img.transpose(_TRANSPOSE[orientation])
        return to_rgb(img)
    except (OSError, ValueError) as err:  # the header was readable, the pixels are not
        bad = BadSampleError(idx, image_where(ref), f"cannot decode image ({err}); fix or remove the image")
        bad.stage = "pixels"  # only ranks that decode see it: the loader keeps the text as it is
        raise bad from None
