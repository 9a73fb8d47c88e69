"""The worst case with several images per sample, and the vision terms on multi-image input.

* ``validate``'s worst case fills every sample with image tokens, split into images of at most
  ``--max-pixels`` (at 8k tokens and 2 Mpx pages: three pages and a part), so the vision terms follow
  ``--seq-length``, not ``--max-pixels``;
* what a real-width vision block (Qwen2.5-VL-7B's 1280 wide, bf16) keeps for several images at once --
  three pages and a smaller image, each in its own attention segments (windows of the windowed blocks,
  whole images in the full-attention ones, as transformers lays them out) -- against the per-patch formula
  (within 10 %; the padded attention rows add a few %), and Qwen3-VL's tower (full attention everywhere);
* attention is per image: three images keep three times what one keeps, up to the padding.
"""

from __future__ import annotations

import pytest
import torch

from mimo_sft.config.checks.context import read_hf_config
from mimo_sft.config.loader import load_config
from mimo_sft.memory import activations as act
from mimo_sft.memory.dims import VisionDims
from mimo_sft.memory.forecast import forecast_memory
from mimo_sft.validate import check_config

#: three "pages" and a part, scaled down from 2 Mpx pages (84 x 120 patches) to keep the CPU quick; the
#: width stays real. 42 x 30 patches: windows of 8 x 8 patches with partial ones along two edges
PAGES = [[1, 42, 30]] * 3 + [[1, 16, 20]]


def _preset(tmp_path_factory, name):
    from mimo_sft.testing.tiny_checkpoint import preset_config

    out = tmp_path_factory.mktemp(name.replace(".", "_"))
    preset_config(name).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def q7b(tmp_path_factory):
    return _preset(tmp_path_factory, "qwen2.5-vl-7b")


@pytest.fixture(scope="module")
def q3_8b(tmp_path_factory):
    return _preset(tmp_path_factory, "qwen3-vl-8b")


def _layout(hf_dir, *extra):
    cfg = load_config(["--component", "language=dp=4", "--component", "images=dp=4,rank_offset=4",
                       "--hf-model", hf_dir, "--allow-random-init", "--dtype", "bf16", "--micro-batch-size", "4",
                       "--global-batch-size", "16", "--gpu-memory-gb", "1000", "--recompute-vision", *extra])
    result = check_config(cfg)
    assert result.ok, result.problems
    return cfg, result


def test_worst_case_fills_every_sample_with_images_of_at_most_max_pixels(q7b):
    """8192 tokens with 2 Mpx pages (2,560 tokens each): three pages and one of 512 tokens per sample, so
    a vision rank's one sample is 8192 x 4 patches, not one page's 2560 x 4."""
    page = 2560 * 28 * 28
    cfg, result = _layout(q7b, "--seq-length", "8192", "--max-pixels", str(page))
    assert "3 images of 2,560 tokens and one of 512" in result.memory["workload"]
    hf = read_hf_config(q7b)
    v = VisionDims.from_config(hf)
    forecast = forecast_memory(cfg, result.layout, hf)
    assert forecast.workload.image_patches == 8192 * v.merge ** 2
    assert forecast.workload.image_tokens == 8192  # the language rank's bridge carries all of them
    per_patch = act.vision_block_input(v, b=2) * v.depth + act.merger_terms(v, b=2)
    flight = 2  # 1F1B over the encoder stage and one language stage
    assert forecast.modules["images"].terms["activations"] == int(flight * per_patch * 8192 * v.merge ** 2)
    # smaller images: more of them, the same patches; a shorter sequence: fewer
    _, half_pages = _layout(q7b, "--seq-length", "8192", "--max-pixels", str(page // 2))
    assert half_pages.memory["modules"]["images"]["terms"]["activations"] == \
        result.memory["modules"]["images"]["terms"]["activations"]
    assert "6 images of 1,280 tokens and one of 512" in half_pages.memory["workload"]
    _, short = _layout(q7b, "--seq-length", "4096", "--max-pixels", str(page))
    assert short.memory["modules"]["images"]["terms"]["activations"] * 2 == pytest.approx(
        result.memory["modules"]["images"]["terms"]["activations"], abs=2)


def _block(hf_dir):
    from mimo_sft.testing import saved_bytes as sb

    block, vcfg = sb.vision_block(hf_dir, dtype=torch.bfloat16)
    return block, vcfg, VisionDims.from_config(read_hf_config(hf_dir))


@pytest.mark.parametrize("blocks", ["windowed", "full attention"])
def test_7b_vision_block_on_three_pages_and_a_part_at_real_width(q7b, blocks):
    from mimo_sft.testing import saved_bytes as sb

    block, vcfg, v = _block(q7b)
    assert v.hidden == 1280
    windows, images = sb.image_segments(vcfg, PAGES)
    assert len(images) == 4 and len(windows) > 4 * len(images)
    segments = windows if blocks == "windowed" else images
    patches = sum(images)
    measured = sb.vision_block_saved(block, vcfg, patches, dtype=torch.bfloat16, segments=segments)
    formula = sum(act.vision_block_terms(v, b=2).values()) * patches
    assert abs(formula - measured) <= 0.10 * measured, (blocks, measured / patches, formula / patches)
    assert measured >= formula  # the formula counts real patches; attention's padded rows come on top


def test_qwen3_vl_tower_block_on_several_images(q3_8b):
    """Qwen3-VL's blocks attend over whole images (no windows): four images of unequal size."""
    from mimo_sft.testing import saved_bytes as sb

    block, vcfg, v = _block(q3_8b)
    images = [n for n in sb.image_segments(vcfg, PAGES)[1]]
    patches = sum(images)
    measured = sb.vision_block_saved(block, vcfg, patches, dtype=torch.bfloat16, segments=images)
    formula = sum(act.vision_block_terms(v, b=2).values()) * patches
    assert abs(formula - measured) <= 0.10 * measured, (measured / patches, formula / patches)


def test_attention_is_per_image(q7b):
    """Three equal images keep three times one image's bytes (each image its own row of the padded batch;
    no term in an image's patches squared)."""
    from mimo_sft.testing import saved_bytes as sb

    block, vcfg, _ = _block(q7b)
    one = sb.image_segments(vcfg, PAGES[:1])[1][0]
    single = sb.vision_block_saved(block, vcfg, one, dtype=torch.bfloat16, segments=[one])
    triple = sb.vision_block_saved(block, vcfg, 3 * one, dtype=torch.bfloat16, segments=[one] * 3)
    assert abs(triple - 3 * single) <= 0.01 * triple, (single, triple)


def test_an_over_budget_tower_is_not_told_to_lower_max_pixels(q7b):
    """Smaller images do not shrink the worst case, so check 23 never offers ``--max-pixels`` for the tower."""
    cfg = load_config(["--component", "language=dp=4", "--component", "images=dp=4,rank_offset=4", "--hf-model", q7b,
                       "--allow-random-init", "--dtype", "bf16", "--micro-batch-size", "4", "--global-batch-size", "16",
                       "--seq-length", "8192", "--recompute-vision", "--use-distributed-optimizer",
                       "--gpu-memory-gb", "12"])
    line = next(str(p) for p in check_config(cfg).problems if str(p).startswith("[23] images"))
    assert "--max-pixels" not in line and "raise images dp" in line and "--seq-length" in line, line
