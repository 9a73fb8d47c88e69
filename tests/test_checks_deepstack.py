"""Check 31: DeepStack layers (decoder layers 0..k-1) must all sit on the first language pipeline stage.
On Qwen3-VL-8B's public architecture (36 layers, DeepStack after layers 0-2). Pure: no processes."""

import copy
import json

import pytest

from mimo_sft.validate import check_config
from mimo_sft.config.checks.deepstack import deepstack_layer_count
from mimo_sft.config.loader import load_config


@pytest.fixture(scope="module")
def config_8b():
    from mimo_sft.testing.tiny_checkpoint import preset_config

    config = preset_config("qwen3-vl-8b").to_dict()
    assert config["vision_config"]["deepstack_visual_indexes"] == [8, 16, 24]
    assert config["text_config"]["num_hidden_layers"] == 36
    return config


def check31(tmp_path, config: dict, pp: int):
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config(["--component", f"language=pp={pp},dp=1,rank_offset=0", "--component",
                       f"images=dp=1,rank_offset={pp}", "--micro-batch-size", "2", "--global-batch-size", "4",
                       "--hf-model", str(tmp_path), "--allow-random-init"])
    return [str(p) for p in check_config(cfg).problems if p.check == 31]


def test_deepstack_layer_count_reads_the_vision_config(config_8b):
    assert deepstack_layer_count(config_8b) == 3
    assert deepstack_layer_count({"vision_config": {}}) == 0 and deepstack_layer_count(None) == 0


@pytest.mark.parametrize("pp", [1, 2, 4, 12])
def test_layouts_that_keep_the_deepstack_layers_on_stage_0_pass(tmp_path, config_8b, pp):
    assert check31(tmp_path, config_8b, pp) == []


def test_without_deepstack_any_pp_passes(tmp_path, config_8b):
    plain = copy.deepcopy(config_8b)
    del plain["vision_config"]["deepstack_visual_indexes"]
    assert check31(tmp_path, plain, 18) == []


def test_deepstack_layers_split_across_stages_are_refused_naming_the_flag(tmp_path, config_8b):
    (msg,) = check31(tmp_path, config_8b, 18)
    assert msg == ("[31] language.pp=18 puts decoder layers 0-1 on the first language pipeline stage, but the model "
                   "adds DeepStack features after layers 0-2 (vision_config.deepstack_visual_indexes), which only "
                   "that stage receives; set language.pp to at most 12 in its --component")
    (msg,) = check31(tmp_path, config_8b, 36)
    assert "decoder layer 0 on the first" in msg and "at most 12" in msg


def test_more_deepstack_layers_than_decoder_layers_names_the_config(tmp_path, config_8b):
    short = copy.deepcopy(config_8b)
    short["text_config"]["num_hidden_layers"] = 2
    (msg,) = check31(tmp_path, short, 2)
    assert "has 2 layers" in msg and "config.json" in msg
