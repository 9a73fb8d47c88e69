"""A save killed (SIGKILL) at any point leaves a loadable checkpoint, and the resumed run continues
exactly where the run that was never killed would have been. Real torchrun processes on CPU."""

import os

import pytest

from e2e_runs import GROUP_STOP, SINGLE, never_stopped, stop_args
from mimo_sft.train.checkpoint.files import complete_checkpoints, resolve_checkpoint
from train_helpers import metrics, new_dir, torchrun

pytestmark = [pytest.mark.e2e, GROUP_STOP]

#: before any part is written, once every part is on disk (before meta.json), before and after the rename,
#: after ``latest`` moved
POINTS = ["start", "before_meta", "before_rename", "after_rename", "after_latest"]


def _args(out, iters, components=SINGLE):
    return [*stop_args(iters, components), "--save-interval", "2", "--output-dir", out]


@pytest.fixture(scope="module")
def never_killed():
    """The losses of the run saved at 2, 4 and 6 and never killed (shared with test_stopping.py)."""
    return {m["step"]: m["loss"] for m in metrics(never_stopped())}


@pytest.mark.parametrize("point", POINTS)
def test_save_killed_at_any_point_resumes_exactly(point, never_killed):
    out = new_dir(f"kill_{point}")
    proc = torchrun(1, _args(out, 4), check=False, extra_env={"MIMO_SFT_TEST_KILL_AT": f"{point}:4"}, real=True)
    assert proc.returncode != 0, "the save of step 4 should have been killed"
    # published before the kill: resume at step 4; otherwise the step-2 checkpoint is what latest names
    resumed_from = 4 if point == "after_latest" else 2
    again = new_dir(f"kill_{point}_resumed")
    # saving into the same folder re-saves step 4 where a killed save left one; keep only the newest
    torchrun(1, _args(again, 5) + ["--load-checkpoint", out + "/checkpoints", "--save", out + "/checkpoints",
                                   "--keep-last-checkpoints", "1"])
    got = {m["step"]: m["loss"] for m in metrics(again)}
    assert sorted(got) == list(range(resumed_from + 1, 6))
    for step, loss in got.items():
        assert loss == never_killed[step], (point, step)
    assert [s for s, _v, _n in complete_checkpoints(out + "/checkpoints")] == [5]
    assert resolve_checkpoint(out + "/checkpoints").endswith("iter_0000005")


@pytest.mark.parametrize("point", ["before_meta", "after_latest"])
def test_async_save_killed_resumes_exactly(point, never_killed):
    """--async-save: the step-4 save is written in the background during step 5 and published by a
    later poll; killed before its meta.json the step-2 checkpoint stays latest, killed after its
    publication it is latest -- either way the resumed run continues exactly (the background write
    saw the state of step 4 although step 5 updated the weights and Adam moments meanwhile: the
    writer is held until step 5 is done, so bytes read from the live tensors instead of the save's
    own copies would be step 5's, and step 6's loss, which follows from step 4's moments, would differ)."""
    out = new_dir(f"kill_async_{point}")
    proc = torchrun(1, _args(out, 6) + ["--async-save"], check=False,
                    extra_env={"MIMO_SFT_TEST_KILL_AT": f"{point}:4", "MIMO_SFT_TEST_HOLD_WRITER": "1"}, real=True)
    assert proc.returncode != 0, "the save of step 4 should have been killed"
    assert "saved checkpoint" in proc.stdout and "iter_0000002" in proc.stdout
    resumed_from = 4 if point == "after_latest" else 2
    assert resolve_checkpoint(out + "/checkpoints").endswith(f"iter_{resumed_from:07d}")
    again = new_dir(f"kill_async_{point}_resumed")
    torchrun(1, _args(again, 6) + ["--async-save", "--load-checkpoint", out + "/checkpoints"])
    got = {m["step"]: m["loss"] for m in metrics(again)}
    assert sorted(got) == list(range(resumed_from + 1, 7))
    for step, loss in got.items():
        assert loss == never_killed[step], (point, step)


def test_full_disk_fails_the_save_in_one_line():
    """A disk that fills up while a background save is written (ENOSPC injected into megatron's
    writer on one of two ranks): the run stops with one line naming the cause and the checkpoint
    that stays latest; the unfinished folder is removed and the step-2 checkpoint still resumes."""
    out = new_dir("enospc")
    args = _args(out, 5, ("language=dp=2", "images=dp=2")) + ["--async-save"]
    proc = torchrun(2, args, check=False, extra_env={"MIMO_SFT_TEST_ENOSPC_AT": "4:1"}, real=True)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "saving step 4" in ln]
    assert len(lines) == 2 and all("the disk is full (No space left on device)" in ln and "iter_0000002 stays the latest" in ln
                         for ln in lines), proc.stderr[-3000:]
    assert "mimo_sft/train/" not in proc.stderr, "no traceback of ours (torchrun's own follows the ranks' exit)"
    root = out + "/checkpoints"
    assert resolve_checkpoint(root).endswith("iter_0000002")
    assert [s for s, _v, _n in complete_checkpoints(root)] == [2]
    assert not any(name.endswith(".tmp") for name in os.listdir(root))
