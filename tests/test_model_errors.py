"""Bad checkpoints and layouts give one-line UserErrors that name the path/tensor and what to change."""

from __future__ import annotations

import json
import os

import pytest

from mimo_sft.errors import UserError
from model_helpers import make_tiny_hf


def _build(d):
    from mimo_sft.model import build_single_process_model

    return build_single_process_model(d)


def _one_line(err: UserError) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("good") / "m"))


def _copy(good, tmp_path):
    import shutil

    d = str(tmp_path / "m")
    shutil.copytree(good, d)
    return d


def test_missing_folder(tmp_path):
    with pytest.raises(UserError) as e:
        _build(str(tmp_path / "nope"))
    assert "nope does not exist" in _one_line(e.value)


def test_missing_config(good, tmp_path):
    d = _copy(good, tmp_path)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(UserError) as e:
        _build(d)
    assert "config.json is missing" in _one_line(e.value)


def test_missing_weights(good, tmp_path):
    d = _copy(good, tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(UserError) as e:
        _build(d)
    assert "no *.safetensors" in _one_line(e.value) and "--allow-random-init" in str(e.value)


def test_missing_shard_listed_in_index(tmp_path):
    d = make_tiny_hf(str(tmp_path / "m"), shards=2)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(UserError) as e:
        _build(d)
    assert "model-00002-of-00002.safetensors is missing" in _one_line(e.value)


def test_corrupt_shard(good, tmp_path):
    d = _copy(good, tmp_path)
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 3])
    with pytest.raises(UserError) as e:
        _build(d)
    assert "model.safetensors" in _one_line(e.value) and "re-download" in str(e.value)


def test_unsupported_family(good, tmp_path):
    d = _copy(good, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "llava"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(UserError) as e:
        _build(d)
    assert "'llava' is not supported" in _one_line(e.value) and "qwen2_5_vl" in str(e.value)


def test_config_disagrees_with_weights_shape(good, tmp_path):
    d = _copy(good, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["text_config"]["intermediate_size"] = 128
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(UserError) as e:
        _build(d)
    msg = _one_line(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "[96, 64]" in msg and "[128, 64]" in msg


def test_config_disagrees_with_weights_missing_tensor(good, tmp_path):
    d = _copy(good, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["text_config"]["num_hidden_layers"] = 3
    cfg["text_config"].pop("layer_types", None)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(UserError) as e:
        _build(d)
    assert "'model.layers.2." in _one_line(e.value) and "missing" in str(e.value)


def test_layout_limits_are_asserted():
    """check_config words these for the user (test_checks, test_families); the builder only asserts them."""
    from mimo_sft.model.builder import _check_layout
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.layout import Layout
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(text_config=dict(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                                            hidden_size=64))
    ad = Qwen25VLAdapter()

    def check(*flags):
        _check_layout(Layout.from_specs([parse_component(f) for f in flags]), cfg, ad, "M")

    check("language=tp=1,dp=2", "images=dp=2")
    with pytest.raises(AssertionError, match="images.tp=2"):
        check("language=dp=2", "images=tp=2,dp=1,rank_offset=2")
    check("language=dp=2", "images=tp=2,dp=1")  # colocated fan-out: the tower is replicated on its tp ranks
    with pytest.raises(AssertionError, match="1 key/value heads"):
        check("language=tp=2,dp=1", "images=dp=2")
    with pytest.raises(AssertionError, match="pp=3 does not divide the model's 2 layers"):
        check("language=pp=3,dp=1,rank_offset=1", "images=dp=1")
    with pytest.raises(AssertionError, match="colocated"):
        check("language=pp=2,dp=1", "images=dp=2")
