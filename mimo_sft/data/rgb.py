"""Decoded images to RGB exactly as transformers' Qwen-VL image processor does it.

Why: the model must train on the pixels inference will show it. ``Image.convert("RGB")`` drops
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


def to_rgb(img):
    """``img`` (any PIL mode, already oriented) as a PIL RGB image, as transformers' processor sees it."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    if img.mode == "RGB" and img.info.get("transparency") is None:  # nothing to convert (a tRNS colour is)
        return img
    return Image.fromarray(convert_to_rgb(img, return_numpy=True))
