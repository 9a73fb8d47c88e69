"""Check 33 (overlap flags, profiler settings), what the DDP of each module is built with, and the
profiler's phase ranges on a real module (no processes)."""

import os

import pytest
import torch
from typer.testing import CliRunner

from mimo_sft.cli import app
from mimo_sft.validate import check_config
from mimo_sft.config.checks.overlap import overlap_param_gather_in_use, parse_profile_steps
from mimo_sft.config.loader import load_config

GOOD = ["--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", "10"]


def problems_33(args):
    res = check_config(load_config(GOOD + args))
    return [str(p) for p in res.problems if p.check == 33]


def test_defaults_overlap_where_exact_and_pass():
    cfg = load_config(GOOD)
    assert cfg.optimizer.overlap_grad_reduce and overlap_param_gather_in_use(cfg)  # distributed optimizer
    assert not overlap_param_gather_in_use(load_config(GOOD + ["--lora-rank", "4"]))  # plain optimizer
    assert not overlap_param_gather_in_use(load_config(GOOD + ["--no-use-distributed-optimizer"]))
    assert not overlap_param_gather_in_use(load_config(GOOD + ["--no-overlap-grad-reduce"]))
    assert not overlap_param_gather_in_use(load_config(GOOD + ["--no-overlap-param-gather"]))
    assert problems_33([]) == []
    assert problems_33(["--ddp-bucket-size", "1000000", "--profile-steps", "3:4", "--profile-ranks", "0,3"]) == []


CASES = [
    (["--overlap-param-gather", "--no-use-distributed-optimizer"],
     "--overlap-param-gather needs the distributed optimizer (--no-use-distributed-optimizer is set)"),
    (["--overlap-param-gather", "--lora-rank", "4"],
     "--overlap-param-gather needs the distributed optimizer (LoRA runs use the plain optimizer)"),
    (["--overlap-param-gather", "--no-overlap-grad-reduce"], "--overlap-param-gather needs --overlap-grad-reduce"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size=0 must be a positive number"),
    (["--ddp-bucket-size", "1000", "--no-overlap-grad-reduce"], "--ddp-bucket-size has no effect with --no-overlap-grad-reduce"),
    (["--profile-steps", "9:11"], "--profile-steps 9:11: step 11 is beyond the run's --train-iters 10"),
    (["--profile-steps", "4:3"], "the first step 4 comes after the last 3"),
    (["--profile-steps", "0:2"], "--profile-steps 0:2: steps count from 1"),
    (["--profile-steps", "three"], "--profile-steps 'three': give the first and last step"),
    (["--profile-steps", "2", "--profile-ranks", "1,4"], "--profile-ranks 1,4: rank 4 does not exist in a run of 4 ranks"),
    (["--profile-steps", "2", "--profile-ranks", "a"], "--profile-ranks 'a': give comma-separated rank numbers"),
    (["--profile-ranks", "0"], "--profile-ranks without --profile-steps"),
]


@pytest.mark.parametrize("args,expected", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_each_bad_setting_is_one_line_naming_its_flag(args, expected):
    found = problems_33(args)
    assert len(found) == 1 and expected in found[0], found


def test_unwritable_profile_folder_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    found = problems_33(["--profile-steps", "1", "--profile-dir", str(blocker / "profile")])
    assert len(found) == 1 and found[0].startswith(f"[33] --profile-dir: the profile folder {blocker}/profile "
                                                   f"cannot be created: {blocker} is a file"), found
    found = problems_33(["--profile-steps", "1", "--output-dir", str(blocker)])
    assert any(f"--output-dir: the profile folder {blocker}/profile" in p for p in found), found


def test_validate_exits_2_with_the_line():
    res = CliRunner().invoke(app, ["validate", "--quiet", *GOOD, "--profile-steps", "5:20"])
    assert res.exit_code == 2 and "[33] --profile-steps 5:20: step 20 is beyond" in res.output
    assert "Traceback" not in res.output


def test_parse_profile_steps():
    assert parse_profile_steps("3:5", 10) == (3, 5) and parse_profile_steps(" 4 ", 10) == (4, 4)
    assert parse_profile_steps(None, 10) is None


def test_a_run_resumed_past_the_profile_range_says_so(capsys, tmp_path):
    from mimo_sft.train.profile import StepProfiler

    for start, said in ((5, True), (4, False), (2, False)):
        StepProfiler(steps=(3, 5), ranks=None, rank=0, folder=str(tmp_path), modules={}).say_if_passed(start)
        out = capsys.readouterr().out
        assert ("--profile-steps 3:5 is before this run's first step (6)" in out and "from 6 on" in out) == said, out
    StepProfiler(steps=(3, 5), ranks=frozenset({1}), rank=0, folder=str(tmp_path), modules={}).say_if_passed(9)
    assert capsys.readouterr().out == ""  # not a profiled rank


def test_ddp_configs_overlap_both_reductions_and_the_language_gather():
    from mimo_sft.train.setup import ddp_config_for

    cfg = load_config(GOOD)
    lang = ddp_config_for(cfg, language=True, bucket_size=1000)
    vision = ddp_config_for(cfg, language=False, bucket_size=1000)
    assert (lang.overlap_grad_reduce, lang.overlap_param_gather, lang.bucket_size) == (True, True, 1000)
    assert (vision.overlap_grad_reduce, vision.overlap_param_gather, vision.bucket_size) == (True, False, 1000)
    one = ddp_config_for(cfg, language=False, bucket_size=None)  # a checkpoint's one vision bucket
    assert (one.overlap_grad_reduce, one.bucket_size) == (False, None)
    assert not lang.check_for_nan_in_grad and not vision.check_for_nan_in_grad  # one check per step instead
    off = ddp_config_for(load_config(GOOD + ["--no-overlap-grad-reduce"]), language=True, bucket_size=None)
    assert (off.overlap_grad_reduce, off.overlap_param_gather) == (False, False)
    assert lang is not ddp_config_for(cfg, language=True, bucket_size=1000)  # megatron writes into it


def test_language_bucket_size_follows_a_dp_reshardable_checkpoint(tmp_path):
    from mimo_sft.train.buckets import DEFAULT_BUCKET_SIZE, META_KEY, language_bucket_size

    assert language_bucket_size(load_config(GOOD), announce=False) == DEFAULT_BUCKET_SIZE
    assert language_bucket_size(load_config(GOOD + ["--no-overlap-grad-reduce"]), announce=False) is None
    ckpt = tmp_path / "iter_0000002"
    ckpt.mkdir()
    for meta, expected in (({"use_distributed_optimizer": True, "distributed_optimizer_format": "dp_reshardable",
                             META_KEY: 5000}, 5000),
                           ({"use_distributed_optimizer": True, "distributed_optimizer_format": "dp_reshardable"}, None),
                           ({"use_distributed_optimizer": True, "distributed_optimizer_format": "fully_reshardable",
                             META_KEY: 5000}, 7000)):
        (ckpt / "meta.json").write_text(__import__("json").dumps({"step": 2, **meta}))
        cfg = load_config(GOOD + ["--ddp-bucket-size", "7000", "--load-checkpoint", str(ckpt)])
        assert language_bucket_size(cfg, announce=False) == expected, meta


def test_vision_bucket_size_follows_a_dp_reshardable_checkpoint(tmp_path):
    """A DP-reshardable checkpoint without ``vision_ddp_bucket_size`` was saved with one vision bucket."""
    from mimo_sft.train.buckets import DEFAULT_BUCKET_SIZE
    from mimo_sft.train.setup import VISION_META_KEY, vision_bucket_size

    assert vision_bucket_size(load_config(GOOD)) == DEFAULT_BUCKET_SIZE
    assert vision_bucket_size(load_config(GOOD + ["--no-overlap-grad-reduce"])) is None
    ckpt = tmp_path / "iter_0000002"
    ckpt.mkdir()
    for meta, expected in (({"use_distributed_optimizer": True, "distributed_optimizer_format": "dp_reshardable",
                             VISION_META_KEY: 5000}, 5000),
                           ({"use_distributed_optimizer": True, "distributed_optimizer_format": "dp_reshardable"}, None),
                           ({"use_distributed_optimizer": True, "distributed_optimizer_format": "fully_reshardable",
                             VISION_META_KEY: 5000}, 7000)):
        (ckpt / "meta.json").write_text(__import__("json").dumps({"step": 2, **meta}))
        cfg = load_config(GOOD + ["--ddp-bucket-size", "7000", "--load-checkpoint", str(ckpt)])
        assert vision_bucket_size(cfg) == expected, meta


def test_module_phases_name_forward_and_backward_ranges():
    """The hooks' ranges on a real two-module model: each module's forward, and its backward from
    the gradient of its output to the gradient of its input (or to the next phase)."""
    from mimo_sft.train.profile import ModulePhases, phase

    encoder, language = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    phases = ModulePhases({"encoder": encoder, "language": language})
    with torch.profiler.profile() as prof:
        language(encoder(torch.randn(3, 4))).sum().backward()
        with phase("optimizer"):
            pass
    phases.remove()
    names = [e.name for e in prof.events() if e.name.endswith(("forward", "backward")) or e.name == "optimizer"]
    assert sorted(names) == sorted(["encoder forward", "language forward", "language backward", "encoder backward",
                                    "optimizer"]), names
    assert not encoder._forward_hooks and not encoder._forward_pre_hooks  # removed
    assert encoder.weight.grad is not None and language.weight.grad is not None
