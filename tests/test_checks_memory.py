"""Checks 21 (activation recomputation) and 22 (sequence parallelism): each bad input gives one line
naming the flag; good settings pass; what does nothing is a note. No processes."""

import json

import pytest

from mimo_sft.validate import check_config
from mimo_sft.config.loader import load_config

LAYOUT = ["--component", "language=tp=2,pp=2,dp=1,rank_offset=0", "--component", "images=dp=1,rank_offset=4",
          "--micro-batch-size", "2", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A config.json only (8 language layers: 4 per stage at pp 2)."""
    folder = tmp_path_factory.mktemp("cfg")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "text_config": {"num_hidden_layers": 8, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2}}))
    return str(folder)


def findings(args, hf_dir=None, numbers=(21, 22)):
    extra = ["--hf-model", hf_dir, "--allow-random-init"] if hf_dir else []
    res = check_config(load_config([*LAYOUT, *extra, *args]))
    problems = [str(p) for p in res.problems if p.check in numbers]
    notes = [str(n) for n in res.notes if n.check in numbers]
    return problems, notes


@pytest.mark.parametrize("args", [
    ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "4"],
    ["--recompute-granularity", "selective", "--recompute-modules", "core_attn,mlp", "--recompute-vision"],
    ["--sequence-parallel", "--seq-length", "1024"],
    ["--sequence-parallel", "--seq-length", "1023", "--in-batch-packing"],
])
def test_good_settings_pass(hf_dir, args):
    assert findings(args, hf_dir) == ([], [])


@pytest.mark.parametrize("args, expected", [
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"],
     "[21] --recompute-num-layers 5 is above the 4 layers of each language pipeline stage (8 layers / pp 2); use 1-4"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "9"],
     "[21] --recompute-num-layers 9 is above the 4 layers"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"],
     "[21] --recompute-num-layers 0 with --recompute-method block recomputes no layer"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "[21] --recompute-num-layers 0 must be >= 1"),
    (["--recompute-method", "block"], "[21] --recompute-method block needs --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "[21] --recompute-num-layers 2 needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "[21] --recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "[21] --recompute-granularity full needs --recompute-num-layers N"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
     "[21] --recompute-modules layernorm needs Transformer Engine"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"],
     "[21] --recompute-modules moe: a Qwen-VL dense decoder has no such part"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attn"],
     "[21] --recompute-modules attn: unknown module; choose from core_attn, mlp"),
    # (padded rows: packing, the default, pads each packed sequence itself)
    (["--sequence-parallel", "--seq-length", "1023", "--no-in-batch-packing"],
     "[22] --seq-length 1023 is not a multiple of language tp=2, which --sequence-parallel splits every row's "
     "positions over; use --seq-length 1024"),
    (["--sequence-parallel", "--no-pad-to-seq-length", "--no-in-batch-packing"], "[22] --sequence-parallel with --no-pad-to-seq-length"),
])
def test_bad_settings_give_one_line_naming_the_flag(hf_dir, args, expected):
    problems, _ = findings(args, hf_dir)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_layer_bound_needs_config_json_and_notes_for_what_does_nothing():
    # without config.json the stage's layer count is unknown: nothing is claimed about it
    assert findings(["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "50"]) == ([], [])
    tp1 = ["--component", "language=tp=1,dp=1", "--component", "images=dp=1", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--sequence-parallel", "--seq-length", "1023"]
    res = check_config(load_config(tp1))
    assert res.ok and any(n.check == 22 and "language tp=1 does nothing" in n.message for n in res.notes)
    frozen = check_config(load_config([*LAYOUT, "--recompute-vision", "--freeze-vision", "--freeze-projector"]))
    assert frozen.ok and any(n.check == 21 and "frozen tower" in n.message for n in frozen.notes)
    lora_vision = check_config(load_config([*LAYOUT, "--recompute-vision", "--freeze-vision", "--freeze-projector",
                                            "--lora-rank", "4", "--lora-target-modules", "vision_attn"]))
    assert not any(n.check == 21 for n in lora_vision.notes)


def test_every_problem_at_once_through_validate(hf_dir):
    from typer.testing import CliRunner

    from mimo_sft.cli import app

    res = CliRunner().invoke(app, ["validate", "--quiet", *LAYOUT, "--hf-model", hf_dir, "--allow-random-init",
                                   "--recompute-method", "block", "--recompute-num-layers", "7",
                                   "--sequence-parallel", "--seq-length", "999", "--no-in-batch-packing"])
    assert res.exit_code == 2, res.output
    for text in ("--recompute-method block needs", "--recompute-num-layers 7 needs", "--seq-length 999"):
        assert text in res.output, res.output
