"""Activation recomputation in one process (no torchrun): the step with recomputation equals the step
without it, per parameter.

Reference: the same tiny Qwen2.5-VL MimoModel built without any recompute setting, on the same
micro-batch (mixed image sizes, two images in one sample, a text-only sample) and the same RNG
state. Each case builds a model with a recompute setting and compares the per-token losses and
every parameter's gradient (fp32, relative 1e-6): megatron's full recomputation (uniform and block)
and selective recomputation of the language model, transformers' checkpointing of the vision
blocks, padded and packed rows, a trained and a frozen tower, and LoRA with dropout on the adapters
of both models (the recomputed forward must draw the same dropout masks, and adapters behind a
frozen embedding must still get their gradient through megatron's re-entrant checkpoint).
The multi-rank layouts (tp 2, pp 2, non-colocated with reordering) are in ``test_memory_e2e.py``.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import make_tiny_hf

pytestmark = pytest.mark.xdist_group("recompute")

FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL_BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
FULL_ONE_GROUP = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules="core_attn,mlp")
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model.check import hf_position_ids, random_batch
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter

    hf_dir = make_tiny_hf(str(tmp_path_factory.mktemp("recompute") / "m"), heads=4, kv_heads=2, layers=2)
    cfg = Qwen25VLAdapter().load_hf_config(hf_dir, {})
    m = cfg.vision_config.spatial_merge_size
    batch = random_batch(cfg, seed=5, image_grids=[[(2 * m, 3 * m)], [(m, m), (3 * m, m)]], text_only=1, text_len=6)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    batch["position_ids"] = hf_position_ids(hf, batch)
    return hf_dir, batch


def _step(hf_dir: str, batch: dict, *, packed: bool = False, seed: int = 1234, **settings):
    """Per-token losses and every parameter's gradient of one forward/backward of a fresh model."""
    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.family import modality_inputs_from_batch
    from mimo_sft.model.lora import apply_lora
    from mimo_sft.train.packing import pack_micro_batch

    model_cfg = ModelConfig(hf_model=hf_dir, **settings)
    model, info = build_single_process_model(hf_dir, model_cfg=model_cfg,
                                             config_overrides={"calculate_per_token_loss": True})
    spec = LoraSpec.from_model_config(model_cfg)
    if spec is not None:
        apply_lora(model, spec, seed=11)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # B = 0 at init would leave A without gradient: give B values
            for name, p in model.named_parameters():
                if name.endswith("lora_b"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.train()
    feed, kwargs = pack_micro_batch(batch) if packed else (batch, None)
    torch.manual_seed(seed)  # the same dropout masks for every case (vision LoRA draws from torch's stream)
    out, mask = model(input_ids=feed["input_ids"], position_ids=feed["position_ids"], attention_mask=None,
                      loss_mask=feed["loss_mask"], labels=feed["labels"],
                      modality_inputs=modality_inputs_from_batch(batch, info.encoder_name), packing_kwargs=kwargs)
    (out * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return out.detach()[mask.bool()], grads, trainable


def _assert_same(ref, got, *, rel=1e-6):
    (ref_loss, ref_grads, ref_trainable), (loss, grads, trainable) = ref, got
    torch.testing.assert_close(loss, ref_loss, rtol=rel, atol=0)
    assert trainable == ref_trainable and set(ref_grads) == trainable, "every trainable parameter gets a gradient"
    assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
    nonzero = 0
    for name, g in ref_grads.items():
        scale = float(g.abs().max())
        diff = float((grads[name].double() - g.double()).abs().max())
        assert diff <= rel * scale + 1e-12, f"{name}: gradient differs by {diff} (largest entry {scale})"
        nonzero += scale > 0
    assert nonzero > len(ref_grads) // 2


@pytest.mark.parametrize("settings", [FULL_UNIFORM, FULL_BLOCK, FULL_ONE_GROUP, SELECTIVE],
                         ids=["full-uniform", "full-block", "full-one-group", "selective"])
def test_language_and_vision_recompute_equal_the_plain_step(setup, settings):
    hf_dir, batch = setup
    ref = _step(hf_dir, batch)
    _assert_same(ref, _step(hf_dir, batch, recompute_vision=True, **settings))


def test_recompute_on_packed_rows_equals_the_packed_step(setup):
    hf_dir, batch = setup
    ref = _step(hf_dir, batch, packed=True)
    _assert_same(ref, _step(hf_dir, batch, packed=True, recompute_vision=True, **FULL_UNIFORM))


def test_vision_recompute_with_a_frozen_tower(setup):
    """Frozen blocks under checkpointing: only the projector (and the language model) train."""
    hf_dir, batch = setup
    ref = _step(hf_dir, batch, freeze_vision=True)
    got = _step(hf_dir, batch, freeze_vision=True, recompute_vision=True, **SELECTIVE)
    _assert_same(ref, got)
    assert not any(".blocks." in n for n in got[1]) and any(".merger." in n for n in got[1])


def test_lora_with_dropout_under_recompute(setup):
    """Language LoRA behind a frozen embedding and a frozen tower (the decoder input needs no grad),
    plus vision adapters: recomputed forwards draw the same dropout masks in both models."""
    hf_dir, batch = setup
    frozen = dict(LORA, freeze_vision=True, freeze_projector=True)
    ref = _step(hf_dir, batch, **frozen)
    assert any("lora_b" in n for n in ref[1]) and not any("modality_submodules" in n for n in ref[1])
    _assert_same(ref, _step(hf_dir, batch, **frozen, **FULL_BLOCK))
    vision = dict(LORA, lora_target_modules="linear_qkv,linear_fc2,vision_attn,vision_mlp")
    ref = _step(hf_dir, batch, **vision)
    assert any("blocks.0.attn.qkv.lora_b" in n for n in ref[1])
    _assert_same(ref, _step(hf_dir, batch, **vision, recompute_vision=True, **FULL_UNIFORM))
    # the masks matter: other draws for the vision adapters' dropout give other gradients
    other = _step(hf_dir, batch, seed=99, **vision)[1]["modality_submodules.images.encoders.qwen_vit.blocks.0.attn.qkv.lora_b"]
    assert not torch.allclose(other, ref[1]["modality_submodules.images.encoders.qwen_vit.blocks.0.attn.qkv.lora_b"])
