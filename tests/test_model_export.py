"""Export: HF -> MimoModel -> HF is bit-exact, keeps side files and names, and transformers loads it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from model_helpers import make_tiny_hf


def _tensors(d):
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    ck = HFCheckpoint(d)
    return ck.full_dict()


@pytest.mark.parametrize("kw", [dict(tie=False, kv_heads=2), dict(tie=True, kv_heads=1, layout="nested", shards=2)],
                         ids=["legacy_untied", "nested_tied_sharded"])
def test_round_trip_bit_exact(tmp_path, kw):
    from mimo_sft.model import build_single_process_model, export_model

    src = make_tiny_hf(str(tmp_path / "src"), **kw)
    model, info = build_single_process_model(src)
    out = str(tmp_path / "out")
    summary = export_model(model, src, out, max_shard_bytes=64 * 1024)  # force several shards
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert "tokenizer_config.json" in summary["copied"] and "config.json" in summary["copied"]
    assert json.load(open(os.path.join(src, "config.json"))) == json.load(open(os.path.join(out, "config.json")))
    assert len(summary["weight_files"]) > 2  # shards + index


def test_export_loads_in_transformers_and_reflects_training(tmp_path):
    """A changed weight survives export, and transformers' Auto class loads the folder."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model import build_single_process_model, export_hf

    src = make_tiny_hf(str(tmp_path / "src"), tie=False)
    model, info = build_single_process_model(src)
    with torch.no_grad():
        model.language_model.decoder.layers[1].mlp.linear_fc1.weight.add_(1.0)
        model.modality_submodules["images"].encoders[info.encoder_name].merger.mlp[0].bias.add_(2.0)
    out = str(tmp_path / "out")
    export_hf(model.state_dict(), src, out)
    hf = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    ref = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    sd, rsd = hf.state_dict(), ref.state_dict()
    changed = sorted(k for k in sd if not torch.equal(sd[k], rsd[k]))
    assert changed == ["model.language_model.layers.1.mlp.gate_proj.weight",
                       "model.language_model.layers.1.mlp.up_proj.weight",
                       "model.visual.merger.mlp.0.bias"], changed


def test_random_init_builds_and_exports(tmp_path):
    from mimo_sft.model import build_single_process_model, export_model

    src = make_tiny_hf(str(tmp_path / "src"), tie=True)
    weights_only = {k: v for k, v in _tensors(src).items()}
    os.remove(os.path.join(src, "model.safetensors"))
    model, info = build_single_process_model(src, random_init=True)
    out = export_model(model, src, str(tmp_path / "out"))
    got = _tensors(out["out_dir"])
    assert sorted(got) == sorted(weights_only)
    assert all(got[k].shape == weights_only[k].shape for k in got)


def test_freeze_flags(tmp_path):
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model import build_single_process_model

    src = make_tiny_hf(str(tmp_path / "src"))
    model, info = build_single_process_model(src, model_cfg=ModelConfig(freeze_vision=True))
    enc = model.modality_submodules["images"].encoders[info.encoder_name]
    trainable = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("merger.") for n in trainable)
    assert all(p.requires_grad for p in model.language_model.parameters())
    model, info = build_single_process_model(src, model_cfg=ModelConfig(freeze_projector=True, freeze_language=True))
    enc = model.modality_submodules["images"].encoders[info.encoder_name]
    assert all(not p.requires_grad for n, p in enc.named_parameters() if n.startswith("merger."))
    assert all(p.requires_grad for n, p in enc.named_parameters() if not n.startswith("merger."))
    assert not any(p.requires_grad for p in model.language_model.parameters())
