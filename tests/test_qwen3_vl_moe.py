"""Qwen3-VL-MoE against transformers' ``Qwen3VLMoeForConditionalGeneration``, one process.

The tiny checkpoint (``testing.tiny_checkpoint``, family ``qwen3_vl_moe``): 8 experts, top 2, every
layer sparse, DeepStack on; each tensor moved away from its init (the router included, so routing is
far from uniform). fp32: logits within 1e-5; one backward's loss and every parameter's gradient --
router and each expert included -- within 1e-5 of the tensor's largest entry. The experts' fused
tensors load in transformers' computing orientation, the released files' transposed one and the
per-expert layout to the same model; a guard shows a wrong expert order fails.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from model_helpers import hf_and_mimo, perturbed_tiny_checkpoint

TOL = 1e-5

BATCHES = {
    "text_only": dict(image_grids=[], text_only=2, text_len=40),
    "multi_image": dict(image_grids=[[(4, 4), (2, 2), (2, 4)]], text_only=0, text_len=30),
    "mixed_sizes": dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)], [(8, 10)]], text_only=1, text_len=30),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return perturbed_tiny_checkpoint(tmp_path_factory, "qwen3_vl_moe", text_layers=2)


@pytest.fixture(scope="module")
def models(moe_dir):
    return hf_and_mimo(moe_dir)


def _logits(hf, ours, info, batch):
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward

    ref, _ = hf_forward(hf, batch)
    return compare(mimo_forward(ours, info, batch, hf_position_ids(hf, batch)), ref, batch["attention_mask"])


def test_the_tiny_model_is_sparse(models):
    hf, ours, _ = models
    t = hf.config.text_config
    assert (t.num_experts, t.num_experts_per_tok) == (8, 2)
    kinds = [type(layer.mlp).__name__ for layer in ours.language_model.decoder.layers]
    assert kinds == ["MoELayer", "MoELayer"], kinds
    assert len(ours.language_model.decoder.layers[0].mlp.experts.local_experts) == 8


@pytest.mark.parametrize("case", sorted(BATCHES))
def test_logits_match_transformers(models, case):
    from mimo_sft.model.check import random_batch

    hf, ours, info = models
    batch = random_batch(hf.config, seed=3, **BATCHES[case])
    assert _logits(hf, ours, info, batch) <= TOL


def test_check_model_command_path(moe_dir):
    from mimo_sft.model.check import check_model

    res = check_model(moe_dir)
    assert res["ok"] and res["family"] == "qwen3_vl_moe" and res["num_images"] >= 2, res


def test_a_wrong_expert_order_would_fail(models):
    """Guard: experts 0 and 1 swapped in every layer (what an EP offset mistake does) moves the logits far."""
    from mimo_sft.model.check import random_batch

    hf, ours, info = models
    batch = random_batch(hf.config, seed=4, **BATCHES["mixed_sizes"])
    experts = [layer.mlp.experts.local_experts for layer in ours.language_model.decoder.layers]
    with torch.no_grad():
        for le in experts:
            a, b = le[0].linear_fc1.weight, le[1].linear_fc1.weight
            tmp = a.clone(); a.copy_(b); b.copy_(tmp)
        bad = _logits(hf, ours, info, batch)
        for le in experts:
            a, b = le[0].linear_fc1.weight, le[1].linear_fc1.weight
            tmp = a.clone(); a.copy_(b); b.copy_(tmp)
    assert bad > 1e-3 and _logits(hf, ours, info, batch) <= TOL


def _gradients(hf, ours, info, batch, adapter):
    """(loss, reference loss, {HF name: (our gradient, transformers' gradient)}) after one backward each."""
    from mimo_sft.model.check import hf_position_ids
    from mimo_sft.model.family import modality_inputs_from_batch

    pos = hf_position_ids(hf, batch)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    hf_labels = batch["input_ids"].masked_fill(~batch["attention_mask"], -100)
    ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
             pixel_values=batch["pixel_values"].float(), image_grid_thw=batch["image_grid_thw"],
             mm_token_type_ids=batch["mm_token_type_ids"], labels=hf_labels).loss
    ref.backward()
    per_token, _ = ours(input_ids=batch["input_ids"], position_ids=pos, attention_mask=None,
                        loss_mask=batch["loss_mask"], labels=batch["labels"],
                        modality_inputs=modality_inputs_from_batch(dict(batch, pixel_values=batch["pixel_values"].float()),
                                                                   info.encoder_name))
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    lang = {n: p.grad for n, p in ours.language_model.named_parameters()}
    enc = {n: p.grad for n, p in ours.modality_submodules["images"].encoders[info.encoder_name].named_parameters()}
    got = adapter.export(lang, enc, hf.config, prefix_style="nested")
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(got) == set(ref_grads)
    return loss.item(), ref.item(), {n: (got[n], g) for n, g in ref_grads.items()}


def test_training_step_gradients_match_transformers(models, moe_dir):
    """Loss and every parameter's gradient after one backward (fp32, 1e-5), router and experts included;
    every expert of every layer receives tokens in this batch (so each expert's comparison means something)."""
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.registry import get_family

    hf, ours, info = models
    batch = random_batch(hf.config, seed=5, **BATCHES["mixed_sizes"])
    loss, ref, pairs = _gradients(hf.train(), ours.train(), info, batch, get_family({"model_type": "qwen3_vl_moe"},
                                                                                    hf_dir=moe_dir))
    hf.eval(), ours.eval()
    assert abs(loss - ref) <= TOL * abs(ref)
    worst = {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for n, (a, b) in pairs.items()}
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    routers = [n for n in pairs if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(pairs[n][1].abs().max() > 0 for n in routers)
    for n in (n for n in pairs if n.endswith("experts.down_proj")):
        assert all(pairs[n][1][e].abs().max() > 0 for e in range(8)), f"{n}: an expert got no tokens"


def _copy(src: str, dst) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


def _relayout(folder: str, how: str) -> None:
    """Rewrite the experts: ``transposed`` as the released files store them, ``per_expert`` one tensor each."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    w = load_file(path)
    for name in [n for n in w if n.endswith("experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gu, dn = w.pop(name), w.pop(base + "down_proj")  # [E, 2I, H], [E, H, I]
        if how == "transposed":
            w[name], w[base + "down_proj"] = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        else:
            inter = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                w[f"{base}{e}.gate_proj.weight"] = gu[e, :inter].contiguous()
                w[f"{base}{e}.up_proj.weight"] = gu[e, inter:].contiguous()
                w[f"{base}{e}.down_proj.weight"] = dn[e].contiguous()
    save_file(w, path, metadata={"format": "pt"})


@pytest.mark.parametrize("how", ["transposed", "per_expert"])
def test_other_expert_layouts_load_to_the_same_model(models, moe_dir, tmp_path, how):
    from mimo_sft.model.builder import build_single_process_model

    folder = _copy(moe_dir, tmp_path / how)
    _relayout(folder, how)
    other, _ = build_single_process_model(folder)
    ref = models[1].state_dict()
    got = other.state_dict()
    keys = [k for k in ref if not k.endswith("_extra_state")]
    assert keys and all(torch.equal(got[k], ref[k]) for k in keys)


def test_export_round_trip_is_bit_exact(moe_dir, models, tmp_path):
    """HF -> mimo -> HF gives the source tensors bit for bit; a trained expert weight lands in its expert
    and transformers loads the folder with our model's logits."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model import export_model
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    hf, ours, info = models
    export_model(ours, moe_dir, str(tmp_path / "same"), max_shard_bytes=64 * 1024)
    src, out = HFCheckpoint(moe_dir).full_dict(), HFCheckpoint(str(tmp_path / "same")).full_dict()
    assert sorted(src) == sorted(out)
    assert all(src[k].dtype == out[k].dtype and torch.equal(src[k], out[k]) for k in src)
    w = ours.language_model.decoder.layers[1].mlp.experts.local_experts[5].linear_fc2.weight
    with torch.no_grad():
        w.add_(0.5)
    try:
        export_model(ours, moe_dir, str(tmp_path / "trained"))
        back = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "trained"), attn_implementation="eager",
                                                           dtype=torch.float32).eval()
        changed = sorted(k for k, v in back.state_dict().items() if not torch.equal(v, hf.state_dict()[k]))
        assert changed == ["model.language_model.layers.1.mlp.experts.down_proj"], changed
        delta = back.state_dict()[changed[0]] - hf.state_dict()[changed[0]]
        assert delta[5].abs().min() > 0.49 and delta[[e for e in range(8) if e != 5]].abs().max() == 0
        batch = random_batch(back.config, seed=7, **BATCHES["mixed_sizes"])
        assert _logits(back, ours, info, batch) <= TOL
    finally:
        with torch.no_grad():
            w.sub_(0.5)


def test_missing_expert_tensor_is_one_line(moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from mimo_sft.errors import UserError
    from mimo_sft.model.builder import build_single_process_model

    bad = _copy(moe_dir, tmp_path / "bad")
    weights = load_file(os.path.join(bad, "model.safetensors"))
    del weights["model.language_model.layers.1.mlp.gate.weight"]
    save_file(weights, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError) as err:
        build_single_process_model(bad)
    msg = str(err.value)
    assert "\n" not in msg and "model.language_model.layers.1.mlp.gate.weight" in msg, msg
