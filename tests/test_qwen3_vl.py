"""Qwen3-VL (dense) against transformers' ``Qwen3VLForConditionalGeneration``, fp32, one process.

The tiny checkpoint is written by ``testing.tiny_checkpoint`` (family ``qwen3_vl``: explicit head_dim
twice hidden/heads, interleaved mRoPE, two DeepStack mergers) with norms and biases moved away from
their init so every tensor matters. Logits within 1e-5 (relative) on text-only, one-image,
multi-image and mixed-size batches; one training step's loss and every parameter's gradient within
1e-5; and guards that the test is not vacuous (chunked mRoPE, or no DeepStack, must fail with images).
"""

from __future__ import annotations

import pytest
import torch

TOL = 1e-5


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration

    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path_factory.mktemp("q3") / "m", family="qwen3_vl", text_layers=3,
                                vision_depth=3, tie_embeddings=False, kv_heads=2)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():  # norms away from 1, biases away from 0, weights larger than HF's init
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p) if ("norm" in name or name.endswith("bias")) else 0.03 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def models(qwen3_dir):
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model.builder import build_single_process_model

    hf = AutoModelForImageTextToText.from_pretrained(qwen3_dir, attn_implementation="eager", dtype=torch.float32)
    ours, info = build_single_process_model(qwen3_dir)
    return hf.eval(), ours.eval(), info


BATCHES = {
    "text_only": dict(image_grids=[], text_only=2),
    "one_image": dict(image_grids=[[(4, 4)]], text_only=0),
    "multi_image": dict(image_grids=[[(4, 4), (2, 2), (2, 4)]], text_only=0),
    "mixed_sizes": dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)], [(8, 10)]], text_only=1),
}


def _logits(models, batch):
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward

    hf, ours, info = models
    ref, ref_loss = hf_forward(hf, batch)
    got = mimo_forward(ours, info, batch, hf_position_ids(hf, batch))
    return compare(got, ref, batch["attention_mask"])


@pytest.mark.parametrize("case", sorted(BATCHES))
def test_logits_match_transformers(models, case):
    from mimo_sft.model.check import random_batch

    hf, _, _ = models
    batch = random_batch(hf.config, seed=3, **BATCHES[case])
    assert _logits(models, batch) <= TOL


def test_check_model_command_path(qwen3_dir):
    from mimo_sft.model.check import check_model

    res = check_model(qwen3_dir)
    assert res["ok"] and res["family"] == "qwen3_vl" and res["num_images"] >= 2, res


def test_chunked_mrope_or_no_deepstack_would_fail(models, monkeypatch):
    """Guards: with images, megatron's chunked mRoPE (Qwen2.5's) or a DeepStack that adds nothing must
    move the logits far past the tolerance -- while text-only batches stay exact with chunked mRoPE."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from mimo_sft.model import deepstack
    from mimo_sft.model.check import random_batch

    hf, ours, _ = models
    images = random_batch(hf.config, seed=4, **BATCHES["mixed_sizes"])
    text = random_batch(hf.config, seed=4, **BATCHES["text_only"])
    rope = ours.language_model.rotary_pos_emb
    monkeypatch.setattr(type(rope), "forward", MultimodalRotaryEmbedding.forward)
    assert _logits(models, text) <= TOL
    assert _logits(models, images) > 1e-3
    monkeypatch.undo()
    assert _logits(models, images) <= TOL
    monkeypatch.setattr(deepstack, "add_deepstack", lambda hidden, inputs, j: hidden)
    assert _logits(models, images) > 1e-3


def test_interleaved_axes_are_transformers():
    """The frequency -> (t, h, w) map equals transformers' recomposition for the released sections."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from mimo_sft.model.qwen3_vl import interleaved_mrope_axes

    for section in ([24, 20, 20], [6, 5, 5], [2, 3, 3]):
        n = sum(section)
        freq = torch.arange(3).view(3, 1, 1, 1).expand(3, 1, 1, n).clone().float()
        stub = type("S", (), {"mrope_section": section})()
        hf = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(stub, freq)[0, 0, :n]
        assert torch.equal(interleaved_mrope_axes(n, section), hf.long()), section


def test_training_step_gradients_match_transformers(models, qwen3_dir):
    """Loss and every parameter's gradient after one backward, ours vs transformers (fp32, 1e-5)."""
    from mimo_sft.model.check import hf_position_ids, random_batch
    from mimo_sft.model.family import modality_inputs_from_batch
    from mimo_sft.model.registry import get_family

    hf, ours, info = models
    batch = random_batch(hf.config, seed=5, **BATCHES["mixed_sizes"])
    pos = hf_position_ids(hf, batch)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    hf_labels = batch["input_ids"].masked_fill(~batch["attention_mask"], -100)
    ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
             pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
             mm_token_type_ids=batch["mm_token_type_ids"], labels=hf_labels).loss
    ref.backward()
    per_token, _ = ours(input_ids=batch["input_ids"], position_ids=pos, attention_mask=None,
                        loss_mask=batch["loss_mask"], labels=batch["labels"],
                        modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    assert abs(float(loss) - float(ref)) <= TOL * abs(float(ref))
    adapter = get_family({"model_type": "qwen3_vl"}, hf_dir=qwen3_dir)
    lang = {n: p.grad for n, p in ours.language_model.named_parameters()}
    enc = {n: p.grad for n, p in ours.modality_submodules["images"].encoders[info.encoder_name].named_parameters()}
    ours_hf_named = adapter.export(lang, enc, hf.config, prefix_style="nested")
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours_hf_named) == set(ref_grads)
    for name, g in ref_grads.items():
        scale = g.abs().max().clamp_min(1e-12)
        assert float((ours_hf_named[name] - g).abs().max() / scale) <= TOL, name
    deep = [n for n in ref_grads if "deepstack_merger_list" in n]
    assert deep and all(ref_grads[n].abs().max() > 0 for n in deep)


def test_data_positions_are_qwen3_vl_positions(models):
    """The data path's mRoPE positions (Qwen2.5's get_rope_index on a stand-in) equal Qwen3-VL's for images."""
    from mimo_sft.data.preprocess import _RopeIndex
    from mimo_sft.model.check import hf_position_ids, random_batch

    hf, _, _ = models
    batch = random_batch(hf.config, seed=6, **BATCHES["mixed_sizes"])
    ours, _ = _RopeIndex(hf.config).get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                                   image_grid_thw=batch["image_grid_thw"],
                                                   attention_mask=batch["attention_mask"].long())
    assert torch.equal(ours, hf_position_ids(hf, batch))


def test_deepstack_split_refuses_a_wrong_width():
    from mimo_sft.model.deepstack import split_deepstack

    x = torch.randn(5, 4 * 3)
    main, deep = split_deepstack(x, hidden=4, num_deepstack=2)
    assert torch.equal(main, x[:, :4]) and torch.equal(deep[1], x[:, 8:])
    with pytest.raises(AssertionError, match=r"expected \[rows, 12\]"):
        split_deepstack(torch.randn(5, 4), hidden=4, num_deepstack=2)
    main, deep = split_deepstack(torch.randn(0, 4), hidden=4, num_deepstack=2)  # megatron's empty payload
    assert main.shape == (0, 4) and len(deep) == 2
