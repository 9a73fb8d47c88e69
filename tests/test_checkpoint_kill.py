"""A save killed (SIGKILL) at any point leaves a loadable checkpoint, and the resumed run continues
exactly where the run that was never killed would have been. Real torchrun processes on CPU."""

import pytest

from mimo_sft.train.checkpoint_files import complete_checkpoints, resolve_checkpoint
from train_helpers import demo_data, metrics, new_dir, tiny_model, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]

POINTS = ["start", "after_model", "before_meta", "before_rename", "after_rename", "after_latest"]


def _args(out, iters):
    return ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--seq-length", "160", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "3e-3", "--lr-decay-style", "constant",
            "--dataloader-type", "cyclic",
            "--no-tensorboard", "--component", "language=dp=1", "--component", "images=dp=1", "--save-interval", "2",
            "--output-dir", out]


@pytest.fixture(scope="module")
def never_killed():
    out = new_dir("kill_reference")
    torchrun(1, _args(out, 5))
    return {m["step"]: m["loss"] for m in metrics(out)}


@pytest.mark.parametrize("point", POINTS)
def test_save_killed_at_any_point_resumes_exactly(point, never_killed):
    out = new_dir(f"kill_{point}")
    proc = torchrun(1, _args(out, 4), check=False, extra_env={"MIMO_SFT_TEST_KILL_AT": f"{point}:4"})
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
