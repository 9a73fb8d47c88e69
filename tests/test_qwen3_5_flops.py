"""Qwen3.5's FLOPs (``mimo_sft.train.flops``) against torch's FlopCounterMode on transformers' own model.

The reference is a tiny random ``Qwen3_5ForConditionalGeneration`` (eager attention, fp32, CPU, no fla:
transformers' torch Gated DeltaNet path) with both layer types, 4 query / 2 key-value attention heads,
2 key / 4 value GDN heads of different head dims, and sequences up to 150 tokens (three 64-token chunks).
Both sides count the same operations (``train.flops``'s conventions), with two adjustments to the counter,
each derived from the module shapes here, not from the formula:

* FlopCounterMode has no formula for ``linalg_solve_triangular``; the delta rule's two unit-lower-
  triangular solves per chunk are counted as forward substitution, ``n*(n-1)`` FLOPs per right-hand
  column (``SOLVE``), the definition the formula uses;
* transformers' ``causal_conv1d_fn`` pads ``kernel-1`` positions on both sides and drops the last
  ``kernel-1`` outputs; the formula counts the S outputs a causal conv keeps (what fla's kernel computes),
  so those dropped outputs, ``2*channels*kernel*(kernel-1)`` per GDN layer and batch row, are taken off.

The model runs with ``use_cache=False``, as training does (with a cache the conv also reads the cached
conv state).
"""

from __future__ import annotations

import math

import pytest
import torch

from mimo_sft.train import flops as F

REL = 1e-3
IMAGE_TOKEN, VSTART, VEND = 156, 158, 159
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def tiny_config(layer_types=LAYER_TYPES):
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                         linear_conv_kernel_dim=4, layer_types=list(layer_types),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1],
                                          "partial_rotary_factor": 0.25, "mrope_interleaved": True},
                         bos_token_id=None, eos_token_id=None, pad_token_id=0),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        image_token_id=IMAGE_TOKEN, video_token_id=157, vision_start_token_id=VSTART, vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3_5ForConditionalGeneration

    cfg = tiny_config()
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    return cfg, model


def _solve_triangular(a_shape, b_shape, *args, left=True, unitriangular=False, out_shape=None, **kwargs):
    """Forward substitution with a unit diagonal: row i of each right-hand column costs i multiply-adds."""
    assert left and unitriangular, "only the delta rule's unit-lower-triangular left solves are expected"
    n, k = b_shape[-2], b_shape[-1]
    return math.prod(b_shape[:-2]) * k * n * (n - 1)


def _counted(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    solve = {torch.ops.aten.linalg_solve_triangular: _solve_triangular}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=solve) as counter:
        fn()
    return counter.get_total_flops()


def _dropped_conv_outputs(model, batch_rows: int) -> int:
    """The conv FLOPs of the ``kernel-1`` outputs transformers' causal conv computes and then drops."""
    out = 0
    for layer in model.model.language_model.layers:
        if hasattr(layer, "linear_attn"):
            channels, _, kernel = layer.linear_attn.conv1d.weight.shape
            out += 2 * channels * kernel * (kernel - 1) * batch_rows
    return out


def _pixels(grids, patch_in=3 * 2 * 16 * 16):
    return torch.randn(sum(t * h * w for t, h, w in grids), patch_in)


@pytest.mark.parametrize("length", [1, 37, 64, 65, 150])
def test_language_single_sequence_matches_counter(hf, length):
    cfg, model = hf
    ids = torch.randint(0, 150, (1, length))
    counted = _counted(lambda: model(input_ids=ids, use_cache=False)) - _dropped_conv_outputs(model, 1)
    assert F.language_forward_flops(cfg.text_config, [length]) == pytest.approx(counted, rel=REL)


def test_language_padded_batch_counts_padded_length(hf):
    """Two samples, the shorter right-padded: both are computed at the padded length (whole chunks of it)."""
    cfg, model = hf
    ids = torch.randint(1, 150, (2, 100))
    mask = torch.ones_like(ids)
    ids[1, 70:] = 0
    mask[1, 70:] = 0
    counted = _counted(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False))
    counted -= _dropped_conv_outputs(model, 2)
    assert F.language_forward_flops(cfg.text_config, [100, 100]) == pytest.approx(counted, rel=REL)
    assert F.language_forward_flops(cfg.text_config, [100, 70]) < counted


def test_whole_model_with_an_image_matches_counter(hf):
    """Text + one image (2 x 3 merged tokens) through the full model: language + Qwen3.5's vision tower
    (Qwen3-VL's blocks and merger, no DeepStack mergers), by the family's formula."""
    from mimo_sft.config.families import family_for_model_type

    cfg, model = hf
    assert family_for_model_type("qwen3_5").vision_flops.endswith(":qwen3_vl")
    assert not hasattr(cfg.vision_config, "deepstack_visual_indexes")
    grids = [(1, 4, 6)]
    ids = [1, 2, 3] + [VSTART] + [IMAGE_TOKEN] * 6 + [VEND] + list(range(5, 75))
    ids = torch.tensor([ids])
    counted = _counted(lambda: model(input_ids=ids, pixel_values=_pixels(grids), image_grid_thw=torch.tensor(grids),
                                     mm_token_type_ids=(ids == IMAGE_TOKEN).long(), use_cache=False))
    counted -= _dropped_conv_outputs(model, 1)
    fwd = F.forward_flops(cfg, [ids.shape[1]], grids)
    assert fwd.total == pytest.approx(counted, rel=REL)
    tower = _counted(lambda: model.model.visual(hidden_states=_pixels(grids), grid_thw=torch.tensor(grids)))
    assert fwd.vision == pytest.approx(tower, rel=REL) and fwd.vision > 0
    assert F.vision_forward_flops(cfg.vision_config, grids, family="qwen3_5") == fwd.vision


def test_matmul_params_are_the_models_linear_and_conv_weights(hf):
    """6N's N: every nn.Linear weight of the language model (GDN in_proj_qkv/z/b/a and out_proj, the gated
    q_proj, k/v/o, the MLP), the GDN conv weights, and the LM head."""
    cfg, model = hf
    n = sum(m.weight.numel() for m in model.model.language_model.modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)))
    n += model.lm_head.weight.numel()
    assert F.language_matmul_params(cfg.text_config) == n
    assert F.dense_flops_per_token(cfg) == 6 * n
    fwd = F.language_forward_flops(cfg.text_config, [150])
    assert fwd - 2 * 150 * n == F.sequence_mixing_flops(cfg.text_config, [150]) > 0


def test_formula_is_sensitive_beyond_tolerance(hf):
    """Mistakes the tolerance would catch: dropping the delta rule, ignoring the chunk padding, or giving
    every layer attention's S x S square."""
    cfg, _ = hf
    t = cfg.text_config
    right = F.language_forward_flops(t, [65])
    nv = t.linear_num_value_heads
    delta = 3 * nv * 128 * F.gdn_mixing_flops_per_head_token(t)  # three GDN layers, 65 tokens -> two chunks
    assert delta / right > 20 * REL
    unpadded = right - 3 * nv * (128 - 65) * F.gdn_mixing_flops_per_head_token(t)
    assert abs(unpadded / right - 1) > 20 * REL
    all_full = tiny_config(["full_attention"] * 4).text_config
    assert abs(F.language_forward_flops(all_full, [65]) / right - 1) > 20 * REL


def test_throughput_counter_counts_a_qwen3_5_batch(hf):
    """The trainer's per-step counter (train.metrics) on a Qwen3.5 config: 3 x forward, language + vision."""
    from mimo_sft.train.metrics import ModelFlopsCounter

    cfg, _ = hf
    grids = torch.tensor([[1, 4, 6]])
    batch = {"input_ids": torch.zeros(2, 80, dtype=torch.long), "attention_mask": torch.ones(2, 80, dtype=torch.long),
             "image_grid_thw": grids}
    counter = ModelFlopsCounter(cfg, 160, count_language=True, count_vision=True)
    counter.count(batch)
    fwd = F.forward_flops(cfg, [80, 80], grids.tolist(), vocab_size=160)
    assert counter.step_flops == pytest.approx(3 * fwd.total) and fwd.vision > 0


def test_real_size_27b_matmul_params():
    """Qwen3.5-27B's language model (Megatron-Bridge's provider sizes): N equals the Linear and conv weights
    of transformers' model built on the meta device, and the GDN layers have no S x S term."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, full_attention_interval=4)
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(out_hidden_size=5120))
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    n = sum(m.weight.numel() for m in model.model.language_model.modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))) + model.lm_head.weight.numel()
    t = cfg.text_config
    assert t.layer_types.count("full_attention") == 16
    assert F.language_matmul_params(t) == n
    # doubling S quadruples only the 16 full-attention layers' square; the 48 GDN layers stay linear
    mix = F.sequence_mixing_flops
    square = 16 * 2 * 2 * 24 * 256
    assert mix(t, [8192]) - 2 * mix(t, [4096]) == pytest.approx(square * (8192 ** 2 - 2 * 4096 ** 2))
