"""Qwen3.5-MoE against transformers' ``Qwen3_5MoeForConditionalGeneration``, one process.

The tiny checkpoint: four hybrid layers (three Gated DeltaNet, one gated attention), every MLP sparse --
8 experts of 48, top 2 -- with a 64-wide shared expert behind its sigmoid gate; every tensor moved away
from its init. fp32: logits within 1e-5; one backward's loss and every gradient (router, experts, shared
expert and its gate included) within 1e-5 of the tensor's largest entry, except the GDN decay path's, whose
fp32 gradient carries ~5e-4 of summation noise (tests/test_qwen3_5.py pins it in fp64) and is held to 1e-3.
Export gives the source tensors bit for bit (per expert, as transformers writes this family).
"""

from __future__ import annotations

import os

import pytest
import torch

from model_helpers import hf_and_mimo, perturbed_tiny_checkpoint
from test_qwen3_vl_moe import _gradients

TOL = 1e-5
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")
BATCHES = {
    "text_only": dict(image_grids=[], text_only=2, text_len=90),
    "mixed_sizes": dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)], [(8, 10)]], text_only=1, text_len=40),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return perturbed_tiny_checkpoint(tmp_path_factory, "qwen3_5_moe", text_layers=4)


@pytest.fixture(scope="module")
def models(moe_dir):
    return hf_and_mimo(moe_dir)


def test_the_tiny_model_is_hybrid_and_sparse_with_a_shared_expert(models):
    _, ours, _ = models
    layers = ours.language_model.decoder.layers
    assert [type(layer.self_attention).__name__ for layer in layers] == ["GatedDeltaNet"] * 3 + ["SelfAttention"]
    assert all(type(layer.mlp).__name__ == "MoELayer" and layer.mlp.shared_experts.gate_weight is not None
               for layer in layers)


@pytest.mark.parametrize("case", sorted(BATCHES))
def test_logits_match_transformers(models, case):
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch

    hf, ours, info = models
    batch = random_batch(hf.config, seed=3, **BATCHES[case])
    ref, _ = hf_forward(hf, batch)
    assert compare(mimo_forward(ours, info, batch, hf_position_ids(hf, batch)), ref, batch["attention_mask"]) <= TOL


def test_check_model_command_path(moe_dir):
    from mimo_sft.model.check import check_model

    res = check_model(moe_dir)
    assert res["ok"] and res["family"] == "qwen3_5_moe", res
    assert res["gdn_kernels"].startswith("Gated DeltaNet: mimo-sft's torch kernels")


class _FusedExperts:
    """The family's export with the experts as transformers' model holds them (fused ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``), to name gradients as its parameters; the export itself writes them per expert."""

    def __init__(self, adapter):
        self.adapter = adapter

    def export(self, language_sd, encoder_sd, hf_cfg, *, prefix_style):
        out = self.adapter.export(language_sd, encoder_sd, hf_cfg, prefix_style=prefix_style)
        for base in sorted({k.rsplit(".", 3)[0] for k in out if ".mlp.experts." in k}):
            n = hf_cfg.text_config.num_experts
            gate_up = [torch.cat([out.pop(f"{base}.{e}.gate_proj.weight"), out.pop(f"{base}.{e}.up_proj.weight")])
                       for e in range(n)]
            out[f"{base}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{base}.down_proj"] = torch.stack([out.pop(f"{base}.{e}.down_proj.weight") for e in range(n)])
        return out


def test_training_step_gradients_match_transformers(models, moe_dir):
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.registry import get_family

    hf, ours, info = models
    batch = random_batch(hf.config, seed=5, **BATCHES["mixed_sizes"])
    loss, ref, pairs = _gradients(hf.train(), ours.train(), info, batch,
                                  _FusedExperts(get_family({"model_type": "qwen3_5_moe"}, hf_dir=moe_dir)))
    hf.eval(), ours.eval()
    assert abs(loss - ref) <= TOL * abs(ref)
    worst = {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for n, (a, b) in pairs.items()}
    strict = {n: w for n, w in worst.items() if not n.endswith(DECAY)}
    assert max(strict.values()) <= TOL, sorted(strict.items(), key=lambda kv: -kv[1])[:5]
    assert max(w for n, w in worst.items() if n.endswith(DECAY)) <= 1e-3
    shared = [n for n in pairs if "shared_expert" in n]
    assert len(shared) == 4 * 4 and all(pairs[n][1].abs().max() > 0 for n in shared)
    experts = [n for n in pairs if ".mlp.experts." in n]
    assert len(experts) == 4 * 2 and all(all(pairs[n][1][e].abs().max() > 0 for e in range(8)) for n in experts)


def test_export_round_trip_is_bit_exact(moe_dir, models, tmp_path):
    from mimo_sft.model import export_model
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    export_model(models[1], moe_dir, str(tmp_path / "same"), max_shard_bytes=64 * 1024)
    src, out = HFCheckpoint(moe_dir).full_dict(), HFCheckpoint(str(tmp_path / "same")).full_dict()
    assert sorted(src) == sorted(out)
    assert all(src[k].dtype == out[k].dtype and torch.equal(src[k], out[k]) for k in src)
    assert os.path.isdir(tmp_path / "same")
