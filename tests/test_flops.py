"""mimo_sft.train.flops against an independent count: torch's FlopCounterMode on transformers' own model.

The reference is a tiny random ``Qwen2_5_VLForConditionalGeneration`` (eager attention, fp32, CPU):
FlopCounterMode counts every matmul / bmm / addmm / convolution the forward actually runs. Our formula
counts the same operations, so the agreement is exact with transformers 5.x; the tolerance
``REL = 1e-3`` only leaves room for tiny matmuls some transformers versions run outside the layers
(older ones built the rotary angles with ``inv_freq @ position_ids``, ~1e-4 of the total here).
Elementwise work (norms, softmax, activations, rotary application, bias adds) is counted by neither
side. Eager attention computes the full S x S score matrix even for causal masks, which is exactly
the convention the formula uses, so causal masking adds no gap. The sensitivity tests below check
that real mistakes (ignoring windows, dropping attention) move the count by far more than REL.
"""

from __future__ import annotations

import pytest
import torch

from mimo_sft.train import flops as F

REL = 1e-3
IMAGE_TOKEN, VSTART, VEND = 156, 158, 159


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=None, pad_token_id=0),
        # window 56 px = 2 merged tokens = 4x4 patches; block 1 attends over whole frames
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE_TOKEN, video_token_id=157, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    return cfg, model


def _counted(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _pixels(grids, patch_in=3 * 2 * 14 * 14):
    return torch.randn(sum(t * h * w for t, h, w in grids), patch_in)


@pytest.mark.parametrize("lengths", [[1], [7], [33], [96]])
def test_language_single_sequence_matches_counter(hf, lengths):
    cfg, model = hf
    ids = torch.randint(0, 150, (1, lengths[0]))
    counted = _counted(lambda: model(input_ids=ids))
    assert F.language_forward_flops(cfg.text_config, lengths) == pytest.approx(counted, rel=REL)


def test_language_padded_batch_counts_padded_length(hf):
    """Two samples, the shorter right-padded: both are computed at the padded length."""
    cfg, model = hf
    ids = torch.randint(1, 150, (2, 40))
    mask = torch.ones_like(ids)
    ids[1, 25:] = 0
    mask[1, 25:] = 0
    counted = _counted(lambda: model(input_ids=ids, attention_mask=mask))
    assert F.language_forward_flops(cfg.text_config, [40, 40]) == pytest.approx(counted, rel=REL)
    # packing-style real lengths are cheaper, and the square term makes [40, 40] != [25 + 55]
    assert F.language_forward_flops(cfg.text_config, [40, 25]) < counted
    assert F.language_forward_flops(cfg.text_config, [80]) > counted


@pytest.mark.parametrize("grids", [
    [(1, 4, 6)],                           # smaller than one window in width
    [(1, 8, 8)],                           # exactly 2x2 windows
    [(1, 18, 12)],                         # partial edge windows, portrait
    [(1, 6, 22), (1, 10, 4), (2, 6, 6)],   # several images, landscape, a two-frame grid
])
def test_vision_tower_matches_counter(hf, grids):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg, model = hf
    tower = model.model.visual
    assert isinstance(tower, Qwen2_5_VisionTransformerPretrainedModel)
    px = _pixels(grids)
    counted = _counted(lambda: tower(hidden_states=px, grid_thw=torch.tensor(grids)))
    assert F.vision_forward_flops(cfg.vision_config, grids) == pytest.approx(counted, rel=REL)
    # a tensor of grids (as image_grid_thw arrives) gives the same number
    as_tensor = F.vision_forward_flops(cfg.vision_config, torch.tensor(grids))
    assert as_tensor == F.vision_forward_flops(cfg.vision_config, grids)


def test_whole_model_with_images_matches_counter(hf):
    """Text + two images through the full model: language (image placeholders included) + vision."""
    cfg, model = hf
    grids = [(1, 4, 6), (1, 8, 4)]
    ids = [1, 2, 3]
    for t, h, w in grids:
        ids += [VSTART] + [IMAGE_TOKEN] * (t * h * w // 4) + [VEND, 5, 6]
    ids = torch.tensor([ids])
    counted = _counted(lambda: model(input_ids=ids, pixel_values=_pixels(grids), image_grid_thw=torch.tensor(grids),
                                     mm_token_type_ids=(ids == IMAGE_TOKEN).long()))
    fwd = F.forward_flops(cfg, [ids.shape[1]], grids)
    assert fwd.total == pytest.approx(counted, rel=REL)
    assert fwd.total == fwd.language + fwd.vision and fwd.vision > 0 and fwd.language > 0


def test_formula_is_sensitive_beyond_tolerance(hf):
    """The test tolerance would catch real mistakes: treating every block as full attention, or
    dropping the attention term, changes the count by much more than REL."""
    import copy

    cfg, _ = hf
    grids = [(1, 18, 12)]
    all_full = copy.deepcopy(cfg.vision_config)
    all_full.fullatt_block_indexes = [0, 1, 2]
    right = F.vision_forward_flops(cfg.vision_config, grids)
    assert abs(F.vision_forward_flops(all_full, grids) / right - 1) > 20 * REL
    full, windowed = F.vision_attention_pairs(cfg.vision_config, grids)
    assert windowed < full
    t = cfg.text_config
    attention = t.num_hidden_layers * 4 * 96 * 96 * t.hidden_size
    assert attention / F.language_forward_flops(t, [96]) > 20 * REL


def test_window_tiling_is_exact():
    """Windows of 4x4 merged tokens (8x8 patches at merge 2) over a 10x6 merged grid:
    rows 4,4,2 and columns 4,2 -> sum of squared window sizes in patches."""
    from types import SimpleNamespace

    v = SimpleNamespace(spatial_merge_size=2, patch_size=14, window_size=112)
    full, windowed = F.vision_attention_pairs(v, [(3, 20, 12)])
    assert full == 3 * (20 * 12) ** 2
    rows, cols = 4 * 4 + 4 * 4 + 2 * 2, 4 * 4 + 2 * 2
    assert windowed == 3 * rows * cols * 2 ** 4


def test_training_dense_and_totals(hf):
    cfg, _ = hf
    t = cfg.text_config
    fwd = F.forward_flops(cfg, [30, 50], [(1, 8, 8)])
    train = F.training_flops(cfg, [30, 50], [(1, 8, 8)])
    assert train.language == 3 * fwd.language and train.vision == 3 * fwd.vision
    assert train.total == pytest.approx(3 * fwd.total)
    frozen_vision = F.training_flops(cfg, [30, 50], [(1, 8, 8)], vision_factor=1)
    assert frozen_vision.vision == fwd.vision and frozen_vision.language == train.language
    # 6N per token is exactly the training language FLOPs without the attention-score term
    head_dim = t.hidden_size // t.num_attention_heads
    attn = t.num_hidden_layers * 4 * (30 ** 2 + 50 ** 2) * t.num_attention_heads * head_dim
    assert F.dense_flops_per_token(cfg) * 80 == pytest.approx(train.language - 3 * attn)
    assert F.dense_flops_per_token(cfg, vocab_size=256) > F.dense_flops_per_token(cfg)
    assert F.forward_flops(cfg, [], None).total == 0


def test_qwen25_vl_3b_parameter_count():
    """6N uses the matmul weights: for Qwen2.5-VL-3B's LM that is its ~3.09 B parameters (tied head)."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(text_config=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                            num_key_value_heads=2, intermediate_size=11008, vocab_size=151936))
    assert F.language_matmul_params(cfg.text_config) == pytest.approx(3.086e9, rel=1e-3)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H800", 989.0), ("NVIDIA H800 PCIe", 756.0),
    ("NVIDIA H20", 148.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A800-SXM4-80GB", 312.0), ("NVIDIA A800 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.05), ("NVIDIA L40", 181.05), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0),
    ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0), ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 3090", 71.0), ("AMD Instinct MI300X", 1307.4), ("AMD Instinct MI300X VF", 1307.4),
    ("H100 SXM", 989.0),
    # unknown or unpublished: no guess
    ("NVIDIA A10G", None), ("Tesla V100-SXM2-32GB", None), ("Tesla T4", None), ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA GeForce RTX 3090 Ti", None), ("cpu", None), ("", None), (None, None),
])
def test_peak_tflops_for(name, peak):
    assert F.peak_tflops_for(name) == peak


def test_every_table_entry_is_reachable():
    for key in F.PEAK_TFLOPS:
        assert F.peak_tflops_for(key) == F.PEAK_TFLOPS[key]
        assert F.peak_tflops_for("NVIDIA " + key) == F.PEAK_TFLOPS[key]


def test_mfu_arithmetic():
    assert F.mfu(494.5, 989.0) == pytest.approx(0.5)
    assert F.mfu(100.0, None) is None and F.mfu(None, 989.0) is None and F.mfu(1.0, 0.0) is None
    # 8 GPUs, 2 s per step, 8e15 FLOPs per step -> 500 TFLOP/s per GPU
    achieved = F.achieved_tflops_per_gpu(8e15, 2.0, 8)
    assert achieved == pytest.approx(500.0)
    assert F.mfu(achieved, F.peak_tflops_for("NVIDIA H200")) == pytest.approx(500 / 989)
    assert F.achieved_tflops_per_gpu(1e12, 0.0, 8) is None
