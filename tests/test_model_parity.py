"""Parity with transformers (relative logit difference <= 1e-5, fp32, CPU) for tiny Qwen2.5-VL models.

Single process through ``check_model`` over several shapes (GQA 4/1, 4/2, 4/4; tied and untied;
sharded and nested-name checkpoints), then two gloo processes: language TP=2 (colocated with a DP=2
encoder, fan-in bridge) and non-colocated (language on rank 0, images on rank 1, megatron's bridge).
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import hf_reference, make_tiny_hf, uniform_batch

TOL = 1e-5

CASES = {
    "h4kv1_untied": dict(heads=4, kv_heads=1, tie=False),
    "h4kv2_tied_flat_config": dict(heads=4, kv_heads=2, tie=True, layers=3, flat_config=True),
    "h4kv4_untied_wide": dict(heads=4, kv_heads=4, hidden=96, ffn=160, vocab=200, tie=False),
    "h8kv2_sharded_nested": dict(heads=8, kv_heads=2, hidden=128, tie=False, layout="nested", shards=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_model_matches_transformers(tmp_path, case):
    from mimo_sft.model.check import check_model

    hf_dir = make_tiny_hf(str(tmp_path / case), **CASES[case])
    res = check_model(hf_dir)
    assert res["ok"], res
    assert res["max_rel_logit_diff"] <= TOL and res["loss_diff"] <= TOL
    assert res["batch_size"] >= 2 and res["num_images"] >= 2
    assert "gdn_kernels" not in res  # (a Qwen3.5 report says which Gated DeltaNet kernels ran: test_qwen3_5)


def test_parity_catches_a_layout_bug(tmp_path, monkeypatch):
    """Guard against a vacuous test: a plain [Q;K;V] fuse (wrong with 2 KV heads) must fail."""
    import mimo_sft.model.decoder_weights as dw
    from mimo_sft.model.check import check_model

    monkeypatch.setattr(dw, "fuse_qkv", lambda q, k, v, groups: torch.cat([q, k, v], dim=0))
    hf_dir = make_tiny_hf(str(tmp_path / "m"), heads=4, kv_heads=2)
    assert not check_model(hf_dir)["ok"]


def _reference(tmp_path, hf_dir, batch):
    logits, _, pos = hf_reference(hf_dir, batch)
    path = str(tmp_path / "ref.pt")
    torch.save({"batch": batch, "logits": logits, "pos": pos}, path)
    return path


@pytest.mark.distributed
def test_language_tp2_colocated_parity(tmp_path):
    from dist_utils import run_distributed
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter
    from model_helpers import worker_tp2_colocated

    hf_dir = make_tiny_hf(str(tmp_path / "m"), heads=4, kv_heads=2, tie=False)
    cfg = Qwen25VLAdapter().load_hf_config(hf_dir, {})
    ref = _reference(tmp_path, hf_dir, uniform_batch(cfg))
    diffs = run_distributed(worker_tp2_colocated, 2, hf_dir, ref)
    assert max(diffs) <= TOL, diffs


@pytest.mark.distributed
def test_non_colocated_parity(tmp_path):
    from dist_utils import run_distributed
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter
    from model_helpers import worker_non_colocated

    hf_dir = make_tiny_hf(str(tmp_path / "m"), heads=4, kv_heads=2, tie=True)
    cfg = Qwen25VLAdapter().load_hf_config(hf_dir, {})
    ref = _reference(tmp_path, hf_dir, random_batch(cfg, seed=5))
    diffs = run_distributed(worker_non_colocated, 2, hf_dir, ref)
    assert diffs[0] <= TOL, diffs


@pytest.mark.distributed
def test_language_pp2_non_colocated_parity(tmp_path):
    """Pipeline stages load their own layers (layer offset) and the tied output copy on the last stage."""
    from dist_utils import run_distributed
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter
    from model_helpers import worker_pp2_non_colocated

    hf_dir = make_tiny_hf(str(tmp_path / "m"), heads=4, kv_heads=2, layers=4, tie=True)
    cfg = Qwen25VLAdapter().load_hf_config(hf_dir, {})
    ref = _reference(tmp_path, hf_dir, random_batch(cfg, seed=7))
    diffs = run_distributed(worker_pp2_non_colocated, 3, hf_dir, ref)
    assert diffs[1] <= TOL, diffs
