"""Streamed export (issue 21 item 3): a dist checkpoint -> sharded safetensors one layer at a time, with the
shards and index transformers' own ``save_pretrained(max_shard_size=...)`` writes, and check 34."""

from __future__ import annotations

import json
import os

import pytest
import torch

from model_helpers import make_tiny_hf

SHARD = 64 * 1024  # bytes: the tiny model makes several shards


def _save_dist_checkpoint(model, folder: str) -> str:
    from megatron.core import dist_checkpointing

    from mimo_sft.train.checkpoint.model import model_sharded_state_dict

    os.makedirs(os.path.join(folder, "model"))
    dist_checkpointing.save(model_sharded_state_dict(model), os.path.join(folder, "model"))
    return folder


def _recording(reader, calls: list):
    def read(model, keys):
        calls.append(list(keys))
        return reader(model, keys)
    return read


def _shard_keys(folder: str) -> dict:
    from safetensors import safe_open

    return {n: sorted(safe_open(os.path.join(folder, n), framework="pt").keys())
            for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")}


def test_bf16_export_streams_layers_into_transformers_shards(tmp_path):
    """bf16 checkpoint -> streamed bf16 export: every weight is exactly the checkpoint's bf16 weight (the
    source's rounded to bf16, plus the changes made before saving), transformers' logits match, each read
    is one layer or one tensor, and a re-save by transformers with the same shard size writes the same
    index and the same tensors in the same files."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model import build_single_process_model
    from mimo_sft.model.export import export_weights
    from mimo_sft.train.checkpoint.save import model_weight_reader

    src = make_tiny_hf(str(tmp_path / "src"), tie=False, kv_heads=2)
    model, info = build_single_process_model(src, model_cfg=ModelConfig(dtype="bf16"))
    with torch.no_grad():  # what training changed: the export must read the checkpoint, not the source
        model.language_model.decoder.layers[1].mlp.linear_fc1.weight.add_(1.0)
        model.modality_submodules["images"].encoders[info.encoder_name].merger.mlp[0].bias.add_(2.0)
    ckpt = _save_dist_checkpoint(model, str(tmp_path / "ckpt"))
    state_keys = [k for k in model.state_dict() if not k.endswith("_extra_state")]
    del model
    calls: list = []
    out = str(tmp_path / "out")
    summary = export_weights(_recording(model_weight_reader(ckpt), calls), src, out, dtype=torch.bfloat16,
                             max_shard_bytes=SHARD)

    assert len(summary["weight_files"]) > 3 and summary["weight_files"][-1] == "model.safetensors.index.json"
    assert sorted(k for c in calls for k in c) == sorted(state_keys)
    for keys in calls:  # one decoder layer / vision block, or a single tensor, per read
        assert len({".".join(k.split(".")[:4]) for k in keys}) == 1 or len(keys) == 1, keys

    ref = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            getattr(ref.model.language_model.layers[1].mlp, name).weight.add_(1.0)
        ref.model.visual.merger.mlp[0].bias.add_(2.0)
    got = AutoModelForImageTextToText.from_pretrained(out, dtype="auto")
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 150, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)

    resaved = str(tmp_path / "resaved")
    got.save_pretrained(resaved, max_shard_size=SHARD)
    index = "model.safetensors.index.json"
    assert json.load(open(os.path.join(out, index))) == json.load(open(os.path.join(resaved, index)))
    assert _shard_keys(out) == _shard_keys(resaved)


def test_streamed_export_keeps_nested_names_tied_embeddings_and_removes_stale_shards(tmp_path):
    """A source in transformers' in-memory naming (``model.language_model.*``) with tied embeddings comes
    back bit-exact in fp32 under its own names; the index lists every tensor in the file that holds it; an
    export into the same folder with fewer shards leaves no stale shard behind."""
    from mimo_sft.model import build_single_process_model
    from mimo_sft.model.export import export_weights
    from mimo_sft.model.hf_checkpoint import HFCheckpoint
    from mimo_sft.train.checkpoint.save import model_weight_reader

    src = make_tiny_hf(str(tmp_path / "src"), tie=True, kv_heads=1, layout="nested", shards=2)
    model, _ = build_single_process_model(src)
    ckpt = _save_dist_checkpoint(model, str(tmp_path / "ckpt"))
    del model
    out = str(tmp_path / "out")
    export_weights(model_weight_reader(ckpt), src, out, max_shard_bytes=SHARD)
    a, b = HFCheckpoint(src).full_dict(), HFCheckpoint(out).full_dict()
    assert sorted(a) == sorted(b) and all(k.startswith(("model.language_model.", "model.visual.")) for k in b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    weight_map = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    files = _shard_keys(out)
    assert {k: f for f, keys in files.items() for k in keys} == weight_map
    export_weights(model_weight_reader(ckpt), src, out, max_shard_bytes=10 * SHARD)
    assert set(_shard_keys(out)) == set(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"].values())
    assert sorted(HFCheckpoint(out).full_dict()) == sorted(a)


@pytest.mark.parametrize("size,ok", [("5GB", True), ("500MB", True), ("65536", True), ("0", False), ("big", False),
                                      ("-5GB", False)])
def test_check_34_export_shard_size(size, ok):
    from mimo_sft.validate import check_config
    from mimo_sft.config.loader import load_config

    cfg = load_config(["--component", "language=dp=1", "--component", "images=dp=1", "--export-shard-size", size])
    found = [str(p) for p in check_config(cfg).problems if "--export-shard-size" in str(p)]
    assert (found == []) == ok, found
    if not ok:
        assert found[0].startswith("check 34") or "34" in found[0], found


def test_export_command_refuses_a_bad_shard_size_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", str(tmp_path), "--out",
                           str(tmp_path / "out"), "--export-shard-size", "5 parsecs"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "--export-shard-size 5 parsecs" in lines[0], lines


def test_qwen3_vl_streamed_export_reads_each_group_and_equals_the_in_memory_export(tmp_path):
    """Qwen3-VL through the streamed export (its adapter converts each group on its own: q/k norms, no qkv
    bias, the blocks' plain MLP, the DeepStack mergers): the trained weights come back bit for bit the
    in-memory export's (tests/test_qwen3_vl.py checks that one against transformers), across several
    shards, with one layer, block or tensor per read."""
    from mimo_sft.model import build_single_process_model, export_model
    from mimo_sft.model.export import export_weights
    from mimo_sft.model.hf_checkpoint import HFCheckpoint
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint
    from mimo_sft.train.checkpoint.save import model_weight_reader

    src = str(write_tiny_checkpoint(tmp_path / "src", family="qwen3_vl", seed=0))
    model, info = build_single_process_model(src)
    enc = model.modality_submodules["images"].encoders[info.encoder_name]
    with torch.no_grad():  # what training changed: the export must read the checkpoint, not the source
        enc.deepstack_merger_list[1].linear_fc2.weight.add_(0.5)
        enc.blocks[0].mlp.linear_fc1.bias.add_(0.25)
        model.language_model.decoder.layers[0].self_attention.q_layernorm.weight.add_(0.5)
    in_memory = str(tmp_path / "in_memory")
    export_model(model, src, in_memory)
    ckpt = _save_dist_checkpoint(model, str(tmp_path / "ckpt"))
    state_keys = [k for k in model.state_dict() if not k.endswith("_extra_state")]
    del model, enc
    calls: list = []
    out = str(tmp_path / "out")
    summary = export_weights(_recording(model_weight_reader(ckpt), calls), src, out, max_shard_bytes=SHARD)
    assert len(summary["weight_files"]) > 3
    assert sorted(k for c in calls for k in c) == sorted(state_keys)
    for keys in calls:
        assert len({".".join(k.split(".")[:4]) for k in keys}) == 1 or len(keys) == 1, keys
    a, b = HFCheckpoint(in_memory).full_dict(), HFCheckpoint(out).full_dict()
    assert sorted(a) == sorted(b) and any("deepstack_merger_list.1" in k for k in b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert not torch.equal(b["model.visual.deepstack_merger_list.1.linear_fc2.weight"],
                           HFCheckpoint(src).full_dict()["model.visual.deepstack_merger_list.1.linear_fc2.weight"])
