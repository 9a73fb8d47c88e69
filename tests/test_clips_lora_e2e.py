"""Clips through a whole LoRA run under torchrun: train, evaluate, resume on another layout, evaluate again; and
``--encoder-balance`` on clips and pages in bf16 (issue 55's acceptance and item 9).

Three launches on a dataset of real clips (H.264 and VP9, a window, a frame list) and pages, with clips in the
training set and in the validation set (``--valid-split``):

1. 2 ranks colocated (language and images dp 2), bf16, LoRA on the language model and the tower's attention (so
   the tower trains and its gradients cross the exchange), ``--encoder-balance``: 2 steps, an evaluation, a
   checkpoint;
2. the same without ``--encoder-balance``: every step's loss and grad norm, and the validation loss, equal run 1's
   to bf16 rounding (balancing moves where an image is encoded, never what the step computes); ``rank_patches``
   of run 1 count what each tower encoded (together, every patch of the step, as run 2's slices);
3. run 1's checkpoint resumed on 1 rank (another layout) with its LoRA settings taken from the checkpoint:
   evaluated before its step (the same validation loss as run 1's last) and after.
"""

from __future__ import annotations

import functools
import math

import pytest

pytest.importorskip("torchvision")

from e2e_runs import finetune, train_rows  # noqa: E402
from train_helpers import metrics, new_dir  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e_clips_lora")]

FLAGS = ["--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "2e-3",
         "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--no-tensorboard", "--dataloader-type", "cyclic",
         "--seed", "5", "--dtype", "bf16", "--valid-split", "4", "--lora-rank", "4", "--lora-dropout", "0.0",
         "--lora-target-modules", "linear_qkv,linear_proj,linear_fc1,linear_fc2,vision_attn", "--scalable-dp",
         "--log-interval", "1"]
COLOCATED_2 = ("language=dp=2", "images=dp=2")


@functools.lru_cache(maxsize=None)
def clip_data() -> str:
    from mimo_sft.testing.clips import write_video_dataset

    return str(write_video_dataset(new_dir("clips_lora_data"), samples=16, seed=11).parent)


@pytest.fixture(scope="module")
def runs():
    data = clip_data()
    balanced = finetune("clips_balanced", 2, [*FLAGS, "--train-iters", "2", "--save-interval", "2",
                                              "--encoder-balance"], components=COLOCATED_2, data=data, timeout=600)
    plain = finetune("clips_plain", 2, [*FLAGS, "--train-iters", "2", "--no-save"], components=COLOCATED_2, data=data,
                     timeout=600)
    lora = {"--lora-rank", "--lora-dropout", "--lora-target-modules"}  # the resume takes them from the checkpoint
    flags = [f for i, f in enumerate(FLAGS) if f not in lora and (i == 0 or FLAGS[i - 1] not in lora)]
    resumed = finetune("clips_resumed", 1, [*flags, "--train-iters", "3", "--no-save", "--eval-at-start",
                                            "--load-checkpoint", f"{balanced.out}/checkpoints"],
                       components=("language=dp=1", "images=dp=1"), data=data, timeout=600)
    return balanced, plain, resumed


def _valid(run_dir: str) -> list[dict]:
    return [r for r in metrics(run_dir) if "valid_loss" in r]


def test_encoder_balance_on_clips_in_bf16_changes_nothing_the_step_computes(runs):
    balanced, plain, _ = runs
    a, b = train_rows(balanced.out), train_rows(plain.out)
    keys = ("step", "loss", "grad_norm", "encoder_balance_moved_images", "rank_patches")
    print([{k: r.get(k) for k in keys} for r in a], [{k: r.get(k) for k in keys} for r in b])
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert any(r.get("encoder_balance_moved_images", 0) > 0 for r in a), a
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert math.isclose(x[key], y[key], rel_tol=2e-2), (key, x[key], y[key])
    assert math.isclose(_valid(balanced.out)[-1]["valid_loss"], _valid(plain.out)[-1]["valid_loss"], rel_tol=2e-2)
    # each tower's work: what it encoded under the flag; together the step's patches, as the slices held them
    for x, y in zip(a, b):
        if "rank_patches" in x and "rank_patches" in y:
            assert math.isclose(sum(x["rank_patches"]), sum(y["rank_patches"]), rel_tol=1e-9), (x, y)


def test_lora_run_with_clips_evaluates_resumes_on_another_layout_and_evaluates_alike(runs):
    balanced, _, resumed = runs
    assert "LoRA" in resumed.proc.stdout and "from the checkpoint" in resumed.proc.stdout, resumed.proc.stdout[-2000:]
    before, after = _valid(balanced.out), _valid(resumed.out)
    assert [r["step"] for r in after] == [2, 3], after
    # the same weights on another layout: the same validation loss (bf16; another reduction order)
    assert math.isclose(after[0]["valid_loss"], before[-1]["valid_loss"], rel_tol=5e-3), (after, before)
    assert [r["step"] for r in train_rows(resumed.out)] == [3]
