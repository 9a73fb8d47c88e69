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
    assert torch.equal(main, x[:, :4]) and torch.equal(deep[:, 4:], x[:, 8:])  # [rows, hidden*k]
    with pytest.raises(AssertionError, match=r"expected \[rows, 12\]"):
        split_deepstack(torch.randn(5, 4), hidden=4, num_deepstack=2)
    main, deep = split_deepstack(torch.randn(0, 4), hidden=4, num_deepstack=2)  # megatron's empty payload
    assert main.shape == (0, 4) and deep.shape == (0, 8)


def test_export_round_trip_is_bit_exact_and_loads_in_transformers(qwen3_dir, models, tmp_path):
    """HF -> mimo -> HF gives the source tensors bit for bit; a trained weight (a DeepStack merger's)
    survives, and transformers loads the folder with the logits of our model."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model import build_single_process_model, export_model
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    model, info = build_single_process_model(qwen3_dir)
    export_model(model, qwen3_dir, str(tmp_path / "same"), max_shard_bytes=64 * 1024)
    src, out = HFCheckpoint(qwen3_dir).full_dict(), HFCheckpoint(str(tmp_path / "same")).full_dict()
    assert sorted(src) == sorted(out) and any("deepstack_merger_list" in k for k in src)
    assert all(src[k].dtype == out[k].dtype and torch.equal(src[k], out[k]) for k in src)
    enc = model.modality_submodules["images"].encoders[info.encoder_name]
    with torch.no_grad():
        enc.deepstack_merger_list[1].linear_fc2.weight.add_(0.5)
        model.language_model.decoder.layers[0].self_attention.q_layernorm.weight.add_(0.5)
    export_model(model, qwen3_dir, str(tmp_path / "trained"))
    hf = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "trained"), attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    changed = sorted(k for k, v in hf.state_dict().items() if not torch.equal(v, models[0].state_dict()[k]))
    assert changed == ["model.language_model.layers.0.self_attn.q_norm.weight",
                       "model.visual.deepstack_merger_list.1.linear_fc2.weight"], changed
    batch = random_batch(hf.config, seed=7, **BATCHES["mixed_sizes"])
    ref, _ = hf_forward(hf, batch)
    assert compare(mimo_forward(model.eval(), info, batch, hf_position_ids(hf, batch)), ref, batch["attention_mask"]) <= TOL


@pytest.mark.parametrize("targets, saved", [
    (("linear_qkv", "vision_mlp", "merger"), []),  # every vision linear that trains has an adapter
    (("linear_fc1", "merger"), ["model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks.0",
                                "model.visual.blocks.1", "model.visual.blocks.2"]),
])
def test_lora_targets_and_peft_export(qwen3_dir, tmp_path, targets, saved):
    """The vision targets adapt Qwen3-VL's own linears (``mlp.linear_fc1/2``, the main merger and every
    DeepStack merger); ``PeftModel`` on transformers' model gives our LoRA model's logits (1e-5)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.lora import apply_lora, lora_modules
    from mimo_sft.model.lora_export import write_peft_adapter

    model, info = build_single_process_model(qwen3_dir)
    spec = LoraSpec(2, 4.0, 0.0, targets)
    apply_lora(model, spec, seed=1)
    vision = sorted(n.split("encoders.qwen_vit.")[1] for n, _ in lora_modules(model) if "encoders" in n)
    mergers = [f"{m}.linear_fc{i}" for m in ("deepstack_merger_list.0", "deepstack_merger_list.1", "merger")
               for i in (1, 2)]
    mlps = [f"blocks.{b}.mlp.linear_fc{i}" for b in range(3) for i in (1, 2)] if "vision_mlp" in targets else []
    assert vision == sorted(mlps + mergers), vision
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    written = write_peft_adapter(model, info, spec, qwen3_dir, str(tmp_path / "adapter"))
    assert written["modules_to_save"] == saved
    base = AutoModelForImageTextToText.from_pretrained(qwen3_dir, attn_implementation="eager", dtype=torch.float32)
    batch = random_batch(base.config, seed=8, **BATCHES["mixed_sizes"])
    ours = mimo_forward(model.eval(), info, batch, hf_position_ids(base, batch))
    peft_logits, _ = hf_forward(PeftModel.from_pretrained(base.eval(), str(tmp_path / "adapter")).eval(), batch)
    assert compare(peft_logits, ours, batch["attention_mask"]) < TOL


def test_model_flops_match_torch_flop_counter(models):
    """Our FLOPs formula (full-attention tower, DeepStack mergers, Qwen3 decoder with its head_dim) against
    torch's FlopCounterMode on transformers' model (eager): tower alone, and the whole forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from mimo_sft.model.check import random_batch
    from mimo_sft.train import flops as F

    hf, _, _ = models
    batch = random_batch(hf.config, seed=9, **BATCHES["mixed_sizes"])
    grids = batch["image_grid_thw"]

    def counted(fn):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    tower = counted(lambda: hf.model.visual(batch["pixel_values"], grid_thw=grids))
    assert F.vision_forward_flops(hf.config.vision_config, grids, family="qwen3_vl") == pytest.approx(tower, rel=1e-3)
    # Qwen2.5's formula (gated MLP, no DeepStack mergers) would be off by far more than the tolerance
    wrong = F.vision_forward_flops(hf.config.vision_config, grids, family="qwen3_vl") - \
        2 * 2 * int(grids.prod(-1).sum()) // 4 * (4 * 32) ** 2
    assert abs(wrong / tower - 1) > 1e-2
    whole = counted(lambda: hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                               pixel_values=batch["pixel_values"], image_grid_thw=grids,
                               mm_token_type_ids=batch["mm_token_type_ids"]))
    S = batch["input_ids"].shape[1]
    fwd = F.forward_flops(hf.config, [S] * batch["input_ids"].shape[0], grids)
    assert fwd.total == pytest.approx(whole, rel=1e-3) and fwd.vision == pytest.approx(tower, rel=1e-12)


def _png(w, h, seed=0) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_data_path_patch_16_pixels_and_token_costs(qwen3_dir):
    """Qwen3-VL's processor through the data path: uint8 patches of 3*16*16 normalised on the device equal
    transformers' float patches (mean = std = 0.5); an image of h x w pixels costs h*w/(32*32) tokens
    (patch 16, merge 2) within --min/--max-pixels, and the reorder cost counts 4 patches a token."""
    from PIL import Image
    import io

    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.processor import load_processor
    from mimo_sft.data.reorder.cost_model import patch_counts
    from mimo_sft.model.pixels import float_patches, pixel_norm_from

    pre = SamplePreprocessor(qwen3_dir, seq_length=512, max_pixels=320 * 256)
    assert (pre.patch_size, pre.merge_size, pre.pixel_dim) == (16, 2, 768)
    png = _png(320, 256)
    u8, grid = pre.pixels(pre.image_specs([png], 0), 0)
    assert grid.tolist() == [[1, 256 // 16, 320 // 16]]
    ref = load_processor(qwen3_dir).image_processor(images=[Image.open(io.BytesIO(png))], return_tensors="pt",
                                                    max_pixels=320 * 256)
    assert pixel_norm_from(qwen3_dir).mean == (0.5, 0.5, 0.5)
    assert torch.allclose(float_patches(u8, pixel_norm_from(qwen3_dir)), ref["pixel_values"], rtol=0, atol=1e-6)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    out = pre.encode(messages, [png], 0, need_pixels=False)
    tokens = int((out["input_ids"] == pre.image_token_id).sum())
    assert tokens == 320 * 256 // (32 * 32)
    ids = out["input_ids"].reshape(1, -1)
    assert int(patch_counts(ids, image_token_id=pre.image_token_id, merge_size=2)) == 4 * tokens
    small = SamplePreprocessor(qwen3_dir, seq_length=512, max_pixels=128 * 128)
    assert small.grid_for_size(256, 320) == (1, 6, 8)  # smart_resize to multiples of 32 px under 16,384 px


def test_real_chat_template_is_accepted_with_assistant_masks(qwen3_dir, tmp_path):
    """A Qwen3-VL folder whose chat template has no {% generation %} markers (as released: no default
    system turn) is read with the family's marked template; Qwen2-VL's (default system turn) is not it, so it
    is kept and its assistant spans come from its prefixes."""
    import shutil

    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.processor import QWEN3_VL_CHAT_TEMPLATE, QWEN_VL_CHAT_TEMPLATE, load_processor

    unmarked = QWEN3_VL_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    folder = tmp_path / "released"
    shutil.copytree(qwen3_dir, folder)
    (folder / "chat_template.jinja").write_text(unmarked)
    proc = load_processor(folder)
    assert proc.chat_template == QWEN3_VL_CHAT_TEMPLATE
    conv = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello there"}]}]
    out = proc.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    ids, mask = (ids[0], mask[0]) if ids and isinstance(ids[0], list) else (ids, mask)
    text = proc.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nHi") and "You are a helpful assistant" not in text
    marked = [t for t, m in zip(ids, mask) if m]
    assert proc.tokenizer.decode(marked) == "Hello there<|im_end|>"
    qwen2 = QWEN_VL_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (folder / "chat_template.jinja").write_text(qwen2)
    assert load_processor(folder).chat_template == qwen2
    pre = SamplePreprocessor(folder, seq_length=256)
    out = pre.encode(conv, [], 0, need_pixels=False)
    assert pre.tokenizer.decode(out["input_ids"]).startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert pre.tokenizer.decode(out["labels"][out["loss_mask"] > 0]) == "Hello there<|im_end|>"


def test_selective_and_vision_recompute_keep_every_gradient(qwen3_dir):
    """The recomputation Qwen3-VL accepts (selective core_attn,mlp; --recompute-vision on the tower with its
    DeepStack taps) gives the gradients of the run without it, bit for bit in fp32 on the CPU."""
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.family import modality_inputs_from_batch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(qwen3_dir)
    batch = random_batch(cfg, seed=10, **BATCHES["mixed_sizes"])
    from mimo_sft.data.preprocess import _RopeIndex

    pos, _ = _RopeIndex(cfg).get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                            image_grid_thw=batch["image_grid_thw"],
                                            attention_mask=batch["attention_mask"].long())

    def grads(**kw):
        model, info = build_single_process_model(qwen3_dir, model_cfg=ModelConfig(**kw))
        model.train()
        out, _ = model(input_ids=batch["input_ids"], position_ids=pos, attention_mask=None,
                       loss_mask=batch["loss_mask"], labels=batch["labels"],
                       modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
        ((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ref = grads()
    got = grads(recompute_granularity="selective", recompute_modules="core_attn,mlp", recompute_vision=True)
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
