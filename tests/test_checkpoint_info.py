"""Check 24 (checkpoint writing, and whether --load-checkpoint resumes on this layout) and
``mimo-sft checkpoint info``: unit tests, no processes.

The checkpoints here are folders with the ``meta.json`` a save writes (the resharding rule reads
only that); ``checkpoint info`` on a real checkpoint written by a run is tested in
test_checkpoint_kill.py (the full-disk test, which leaves one behind).
"""

import json
import os
import subprocess
import sys

import pytest

from mimo_sft.validate import check_config
from mimo_sft.config.checks.checkpoint import reshard_problem
from mimo_sft.config.loader import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = [{"name": "language", "dp": 2, "tp": 1, "pp": 1, "cp": 1, "etp": 1, "rank_offset": 0},
         {"name": "images", "dp": 2, "tp": 1, "pp": 1, "cp": 1, "etp": 1, "rank_offset": 2}]


def _checkpoint(tmp_path, fmt):
    """A run's checkpoint folder (root with ``latest``) whose meta.json says how it was saved."""
    root = tmp_path / "checkpoints"
    (root / "iter_0000004").mkdir(parents=True)
    meta = {"step": 4, "consumed_samples": 32, "world_size": 4, "layout": SAVED, "dtype": "fp32",
            "use_distributed_optimizer": fmt is not None, **({"distributed_optimizer_format": fmt} if fmt else {})}
    (root / "iter_0000004" / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text("iter_0000004\n")
    return str(root)


def _problems(args):
    res = check_config(load_config(args))
    return [str(p) for p in res.problems if p.check == 24], [str(n) for n in res.notes if n.check == 24]


def _layout(*components):
    return [a for c in components for a in ("--component", c)] + ["--micro-batch-size", "4", "--global-batch-size", "8"]


def test_a_dp_only_checkpoint_is_refused_on_another_tp_and_resumes_on_another_dp(tmp_path):
    ckpt = _checkpoint(tmp_path, "dp_reshardable")
    tp2 = _layout("language=tp=2,dp=1", "images=dp=2")
    problems, _ = _problems(tp2 + ["--load-checkpoint", ckpt, "--use-distributed-optimizer"])
    assert len(problems) == 1 and "saved in the DP-only form with language tp=1,pp=1" in problems[0]
    assert "this layout has tp=2,pp=1" in problems[0] and "--save-reshardable" in problems[0]
    # another DP size, colocated: fine
    dp1 = _layout("language=dp=2", "images=dp=2")
    assert _problems(dp1 + ["--load-checkpoint", ckpt, "--use-distributed-optimizer"])[0] == []


@pytest.mark.parametrize("fmt", [None, "fully_reshardable"])
def test_a_reshardable_checkpoint_resumes_on_any_layout(tmp_path, fmt):
    ckpt = _checkpoint(tmp_path, fmt)
    for comps in (("language=tp=2,dp=1", "images=dp=2"), ("language=pp=2,dp=1", "images=dp=2,rank_offset=2")):
        assert _problems(_layout(*comps) + ["--load-checkpoint", ckpt])[0] == []
        assert reshard_problem(json.load(open(os.path.join(ckpt, "iter_0000004", "meta.json"))), []) is None


def test_checkpoint_writing_notes():
    _, notes = _problems(_layout("language=dp=2", "images=dp=2") + ["--async-save", "--save-reshardable",
                                                                    "--no-use-distributed-optimizer"])
    assert any("--async-save without --save-interval" in n for n in notes)
    assert any("--save-reshardable has no effect without the distributed optimizer" in n for n in notes)
    _, notes = _problems(_layout("language=dp=2", "images=dp=2") + ["--async-save", "--save-interval", "2",
                                                                    "--save-reshardable", "--use-distributed-optimizer"])
    assert notes == []
    # LoRA keeps the plain optimizer: nothing to reshard, and its checkpoints name no distributed format
    _, notes = _problems(_layout("language=dp=2", "images=dp=2") + ["--save-interval", "2", "--save-reshardable",
                                                                    "--use-distributed-optimizer", "--lora-rank", "8"])
    assert any("--save-reshardable has no effect with LoRA" in n for n in notes)
    from mimo_sft.train.checkpoint.optimizer import save_format

    assert save_format(load_config(_layout("language=dp=2", "images=dp=2") + ["--lora-rank", "8"])) is None
    assert save_format(load_config(_layout("language=dp=2", "images=dp=2"))) == "dp_reshardable"


def _info(*args):
    return subprocess.run([sys.executable, "-m", "mimo_sft", "checkpoint", "info", *args], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def test_checkpoint_info_answers_whether_it_resumes_on_a_layout(tmp_path):
    ckpt = _checkpoint(tmp_path, "dp_reshardable")
    ok = _info(ckpt, "--component", "language=dp=1", "--component", "images=dp=1,rank_offset=1", "--json")
    assert ok.returncode == 0, ok.stderr
    info = json.loads(ok.stdout)
    assert info["step"] == 4 and info["optimizer"] == "distributed" and info["resumes_on"]["ok"]
    assert info["distributed_optimizer_format"] == "dp_reshardable" and info["modules"] == {}
    no = _info(ckpt, "--component", "language=tp=2,dp=1", "--component", "images=dp=2")
    assert no.returncode == 1 and "resume on language=tp=2" in no.stdout and "no: its distributed-optimizer" in no.stdout
    missing = _info(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error: checkpoint") and "Traceback" not in missing.stderr
