"""Qwen3.5 (dense, hybrid Gated DeltaNet) against transformers' ``Qwen3_5ForConditionalGeneration``, one process.

The tiny checkpoint (``testing.tiny_checkpoint``, family ``qwen3_5``) has four decoder layers in the
released 3:1 pattern (three GDN layers, one gated full-attention layer), 2 key / 4 value GDN heads,
partial rotary with interleaved mRoPE; every tensor is moved away from its init (zero-centred norms,
A_log, dt_bias, the GDN output norm included) so each one matters. Sequences run past one 64-token
chunk of the delta rule. fp32: logits within 1e-5; one backward's loss and every parameter's
gradient within 1e-5 of each tensor's largest entry. The guards show the comparisons can fail
(a plain RMSNorm instead of the zero-centred one; the q/gate halves swapped).
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import hf_and_mimo, perturbed_tiny_checkpoint

TOL = 1e-5

#: per sample with images, the (h, w) grids in patches; text-only samples after them. 30 text tokens
#: plus images: rows of 70-130 tokens, past the delta rule's 64-token chunk
BATCHES = {
    "text_only": dict(image_grids=[], text_only=2, text_len=90),
    "one_image": dict(image_grids=[[(4, 4)]], text_only=0, text_len=70),
    "multi_image": dict(image_grids=[[(4, 4), (2, 2), (2, 4)]], text_only=0, text_len=60),
    "mixed_sizes": dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)], [(8, 10)]], text_only=1, text_len=40),
}


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    return perturbed_tiny_checkpoint(tmp_path_factory, "qwen3_5", text_layers=4)


@pytest.fixture(scope="module")
def models(q35_dir):
    return hf_and_mimo(q35_dir)


def _logits(models, batch):
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward

    hf, ours, info = models
    ref, _ = hf_forward(hf, batch)
    got = mimo_forward(ours, info, batch, hf_position_ids(hf, batch))
    return compare(got, ref, batch["attention_mask"])


def test_the_tiny_model_has_both_layer_kinds(models):
    hf, ours, _ = models
    t = hf.config.text_config
    assert t.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert t.linear_num_value_heads == 2 * t.linear_num_key_heads
    kinds = [type(layer.self_attention).__name__ for layer in ours.language_model.decoder.layers]
    assert kinds == ["GatedDeltaNet"] * 3 + ["SelfAttention"], kinds


@pytest.mark.parametrize("case", sorted(BATCHES))
def test_logits_match_transformers(models, case):
    from mimo_sft.model.check import random_batch

    hf, _, _ = models
    batch = random_batch(hf.config, seed=3, **BATCHES[case])
    assert batch["input_ids"].shape[1] > 64
    assert _logits(models, batch) <= TOL


def test_check_model_command_path(q35_dir):
    from mimo_sft.model.check import check_model

    res = check_model(q35_dir)
    assert res["ok"] and res["family"] == "qwen3_5" and res["num_images"] >= 2 and res["seq_length"] > 64, res
    assert res["gdn_kernels"] == "Gated DeltaNet: mimo-sft's torch kernels (model.gdn_kernels): fla is not installed"


def test_plain_norms_or_swapped_gates_would_fail(models, monkeypatch):
    """Guards: a plain RMSNorm (x_hat * w) where Qwen3.5 has x_hat * (1 + w), or the attention's q and
    output-gate halves taken the wrong way round, move the logits far past the tolerance."""
    from mimo_sft.model import hybrid_weights, norm
    from mimo_sft.model.check import random_batch

    hf, _, _ = models
    batch = random_batch(hf.config, seed=4, **BATCHES["mixed_sizes"])
    monkeypatch.setattr(norm.ZeroCenteredRMSNorm, "forward",
                        lambda self, x: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
                                         * self.weight.float()).to(x.dtype))
    assert _logits(models, batch) > 1e-3
    monkeypatch.undo()
    assert _logits(models, batch) <= TOL
    q, gate = torch.randn(8, 3), torch.randn(8, 3)
    joined = hybrid_weights.join_q_gate(q, gate, head_dim=4)
    assert torch.equal(joined[4:8], gate[:4]) and not torch.equal(joined[4:8], q[4:8])


#: the decay path (g = -exp(A_log) * softplus(a + dt_bias)): their gradients sum many terms that cancel, so
#: fp32 rounding elsewhere moves them by up to ~5e-4 of their size (transformers' fp32 model against itself
#: with the rest in fp64 moves them as much); they are compared in the fp64 run
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")


def _fp64_transformers_rule():
    """transformers' own ``torch_chunk_gated_delta_rule`` computing in fp64: the same code, with the
    ``torch.float32`` it casts to read as ``torch.float64``."""
    import inspect
    import types

    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_mod

    fn = inspect.unwrap(hf_mod.torch_chunk_gated_delta_rule)
    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.float32 = torch.float64
    return types.FunctionType(fn.__code__, {**fn.__globals__, "torch": proxy}, fn.__name__, fn.__defaults__)


def _gradients(hf, ours, info, batch, adapter):
    """(loss, reference loss, {HF name: (our gradient, transformers' gradient)}) after one backward each."""
    from mimo_sft.model.check import hf_position_ids
    from mimo_sft.model.family import modality_inputs_from_batch

    dtype = next(hf.parameters()).dtype
    pos = hf_position_ids(hf, batch)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    hf_labels = batch["input_ids"].masked_fill(~batch["attention_mask"], -100)
    ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
             pixel_values=batch["pixel_values"].to(dtype), image_grid_thw=batch["image_grid_thw"],
             mm_token_type_ids=batch["mm_token_type_ids"], labels=hf_labels).loss
    ref.backward()
    per_token, _ = ours(input_ids=batch["input_ids"], position_ids=pos, attention_mask=None,
                        loss_mask=batch["loss_mask"], labels=batch["labels"],
                        modality_inputs=modality_inputs_from_batch(dict(batch, pixel_values=batch["pixel_values"].to(dtype)),
                                                                   info.encoder_name))
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    lang = {n: p.grad for n, p in ours.language_model.named_parameters()}
    enc = {n: p.grad for n, p in ours.modality_submodules["images"].encoders[info.encoder_name].named_parameters()}
    got = adapter.export(lang, enc, hf.config, prefix_style="nested")
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(got) == set(ref_grads)
    return loss.item(), ref.item(), {n: (got[n], g) for n, g in ref_grads.items()}


def _worst(pairs) -> dict:
    return {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for n, (a, b) in pairs.items()}


def test_training_step_gradients_match_transformers(models, q35_dir):
    """Loss and every parameter's gradient after one backward, ours vs transformers (fp32, 1e-5), except
    the decay path's (``DECAY``: the fp64 test below)."""
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.registry import get_family

    hf, ours, info = models
    batch = random_batch(hf.config, seed=5, **BATCHES["mixed_sizes"])
    loss, ref, pairs = _gradients(hf, ours, info, batch, get_family({"model_type": "qwen3_5"}, hf_dir=q35_dir))
    assert abs(loss - ref) <= TOL * abs(ref)
    worst = _worst({n: p for n, p in pairs.items() if not n.endswith(DECAY)})
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    gdn = [n for n in pairs if "linear_attn" in n]
    assert len(gdn) == 3 * 9 and all(pairs[n][1].abs().max() > 0 for n in gdn)


def test_training_step_gradients_match_transformers_in_fp64(q35_dir, monkeypatch):
    """The same backward in fp64 on both sides (transformers' delta rule made fp64, ``_fp64_transformers_rule``):
    every gradient, the decay path's included, within 1e-6."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_mod

    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.registry import get_family

    monkeypatch.setattr(hf_mod, "torch_chunk_gated_delta_rule", _fp64_transformers_rule())
    hf = AutoModelForImageTextToText.from_pretrained(q35_dir, attn_implementation="eager", dtype=torch.float64)
    ours, info = build_single_process_model(q35_dir)
    ours = ours.double()
    batch = random_batch(hf.config, seed=5, **BATCHES["mixed_sizes"])
    loss, ref, pairs = _gradients(hf.eval(), ours.eval(), info, batch,
                                  get_family({"model_type": "qwen3_5"}, hf_dir=q35_dir))
    assert abs(loss - ref) <= 1e-6 * abs(ref)  # both losses are computed on fp32 logits
    worst = _worst(pairs)
    assert max(worst.values()) <= 1e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    assert all(n in worst for n in pairs if n.endswith(DECAY))


def test_data_positions_are_qwen3_5_positions(models):
    """The data path's mRoPE positions (Qwen2.5's get_rope_index on a stand-in) equal Qwen3.5's for images."""
    from mimo_sft.data.preprocess import _RopeIndex
    from mimo_sft.model.check import hf_position_ids, random_batch

    hf, _, _ = models
    batch = random_batch(hf.config, seed=6, **BATCHES["mixed_sizes"])
    ours, _ = _RopeIndex(hf.config).get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                                   image_grid_thw=batch["image_grid_thw"],
                                                   attention_mask=batch["attention_mask"].long())
    assert torch.equal(ours, hf_position_ids(hf, batch))


def test_export_round_trip_is_bit_exact_and_loads_in_transformers(q35_dir, models, tmp_path):
    """HF -> mimo -> HF gives the source tensors bit for bit (mtp.* copied through); a trained GDN
    weight survives, and transformers loads the folder with the logits of our model."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model import build_single_process_model, export_model
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    src_dir = tmp_path / "src"
    src_dir.mkdir()
    for f in __import__("os").listdir(q35_dir):
        __import__("shutil").copy(f"{q35_dir}/{f}", src_dir / f)
    weights = load_file(str(src_dir / "model.safetensors"))
    weights["mtp.fc.weight"] = torch.randn(4, 8)  # a released checkpoint's multi-token-prediction tensor
    save_file(weights, str(src_dir / "model.safetensors"), metadata={"format": "pt"})
    model, info = build_single_process_model(str(src_dir))
    export_model(model, str(src_dir), str(tmp_path / "same"), max_shard_bytes=64 * 1024)
    src, out = HFCheckpoint(str(src_dir)).full_dict(), HFCheckpoint(str(tmp_path / "same")).full_dict()
    assert sorted(src) == sorted(out) and "mtp.fc.weight" in out
    assert all(src[k].dtype == out[k].dtype and torch.equal(src[k], out[k]) for k in src)
    with torch.no_grad():
        model.language_model.decoder.layers[1].self_attention.out_norm.weight.add_(0.5)
        model.language_model.decoder.layers[3].self_attention.linear_qkv.weight[-1].add_(0.5)
    export_model(model, q35_dir, str(tmp_path / "trained"))
    hf = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "trained"), attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    changed = sorted(k for k, v in hf.state_dict().items() if not torch.equal(v, models[0].state_dict()[k]))
    assert changed == ["model.language_model.layers.1.linear_attn.norm.weight",
                       "model.language_model.layers.3.self_attn.v_proj.weight"], changed
    batch = random_batch(hf.config, seed=7, **BATCHES["mixed_sizes"])
    ref, _ = hf_forward(hf, batch)
    assert compare(mimo_forward(model.eval(), info, batch, hf_position_ids(hf, batch)), ref, batch["attention_mask"]) <= TOL


def test_missing_gdn_tensor_is_one_line(q35_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from mimo_sft.errors import UserError
    from mimo_sft.model.builder import build_single_process_model

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in __import__("os").listdir(q35_dir):
        __import__("shutil").copy(f"{q35_dir}/{f}", bad / f)
    weights = load_file(str(bad / "model.safetensors"))
    del weights["model.language_model.layers.2.linear_attn.A_log"]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError) as err:
        build_single_process_model(str(bad))
    msg = str(err.value)
    assert "\n" not in msg and "model.language_model.layers.2.linear_attn.A_log" in msg, msg
