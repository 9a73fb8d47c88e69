"""Check 31: DeepStack layers (decoder layers 0..k-1) must all sit on the first language pipeline stage.
Pure: config.json files only, no processes."""

import json

import pytest

from mimo_sft.config.checks import check_config
from mimo_sft.config.checks_deepstack import deepstack_layer_count
from mimo_sft.config.loader import load_config


def hf_dir(tmp_path, layers: int, deepstack):
    vision = {"depth": 4} if deepstack is None else {"depth": 4, "deepstack_visual_indexes": deepstack}
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_vl", "vision_config": vision,
        "text_config": {"num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2}}))
    return str(tmp_path)


def check31(folder, language: str, images: str = "images=dp=1,rank_offset=4"):
    cfg = load_config(["--component", language, "--component", images, "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--hf-model", folder, "--allow-random-init"])
    return [str(p) for p in check_config(cfg).problems if p.check == 31]


def test_deepstack_layer_count_reads_the_vision_config():
    assert deepstack_layer_count({"vision_config": {"deepstack_visual_indexes": [8, 16, 24]}}) == 3
    assert deepstack_layer_count({"vision_config": {}}) == 0 and deepstack_layer_count(None) == 0


@pytest.mark.parametrize("layers, deepstack, language", [
    (8, [1, 2, 3], "language=pp=2,dp=2,rank_offset=0"),     # 4 layers on stage 0 >= 3
    (6, [1, 2, 3], "language=pp=2,dp=2,rank_offset=0"),     # exactly 3
    (4, [1, 2, 3], "language=pp=1,dp=4,rank_offset=0"),     # one stage holds everything
    (4, None, "language=pp=4,dp=1,rank_offset=0"),          # no DeepStack (Qwen2.5-VL-like config)
])
def test_layouts_that_keep_the_deepstack_layers_on_stage_0_pass(tmp_path, layers, deepstack, language):
    assert check31(hf_dir(tmp_path, layers, deepstack), language) == []


def test_deepstack_layers_split_across_stages_are_refused_naming_the_flag(tmp_path):
    folder = hf_dir(tmp_path, 8, [5, 11, 17])
    (msg,) = check31(folder, "language=pp=4,dp=1,rank_offset=0")
    assert msg == ("[31] language.pp=4 puts decoder layers 0-1 on the first language pipeline stage, but the model "
                   "adds DeepStack features after layers 0-2 (vision_config.deepstack_visual_indexes), which only "
                   "that stage receives; set language.pp to at most 2 in its --component")
    (msg,) = check31(hf_dir(tmp_path, 4, [1, 2, 3]), "language=pp=2,dp=2,rank_offset=0")
    assert "layers 0-1 on the first" in msg and "at most 1" in msg


def test_more_deepstack_layers_than_decoder_layers_names_the_config(tmp_path):
    (msg,) = check31(hf_dir(tmp_path, 2, [1, 2, 3]), "language=pp=2,dp=2,rank_offset=0")
    assert "has 2 layers" in msg and "config.json" in msg
