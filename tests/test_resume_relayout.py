"""Resume on another layout (torchrun, gloo, CPU): a run saved with one layout continues on another
with the continuous run's losses and gradient norms.

What a checkpoint carries across layouts: weights and optimizer state (Adam moments and step, the
fp32 main weights of a bf16 run) as megatron dist-checkpoints, the step (hence the learning rate)
and the data position. The step after the checkpoint checks the weights and the data position, the
one after it the optimizer state. Only the RNG streams restart from the seed, and this model uses
none (no dropout), so the continued run must equal the continuous one up to the reduction order of
the other layout (relative 1e-5). On the same layout everything is restored: bit for bit.

The 4-rank distributed-optimizer run (``tests/e2e_runs.py: resume_continuous``) is resumed twice: on
its own layout and on 2 ranks. The bf16 relayout: test_train_bf16.py.
"""

import shutil

import pytest
import torch

from e2e_runs import (GROUP_RESUME, NON_COLOCATED_4, RELAYOUT_NOTICE, RESUME_FLAGS, assert_continues, finetune,
                      resume_continuous)
from train_helpers import checkpoint_tensors, metrics, new_dir, optimizer_tensors

pytestmark = [pytest.mark.e2e]

BASE = ["--seq-length", "160", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--dataloader-type", "cyclic", "--seed", "7",
        "--no-tensorboard", "--scalable-dp", "--weight-decay", "0.05"]  # no decay on norms and biases
FOUR = list(NON_COLOCATED_4)
ONE = ["language=dp=1", "images=dp=1"]
#: 2 ranks: colocated, same DP (plain); non-colocated, DP 2 -> 1 on the same TP/PP (distributed, the DP-only
#: form it saves by default)
TWO = {"plain": ["language=dp=2", "images=dp=2"], "distributed": ["language=dp=1", "images=dp=1,rank_offset=1"]}
#: colocated with language tp 2 fed by encoder DP 2: another TP, which the DP-only form cannot take
TP2 = ["language=tp=2,dp=1", "images=dp=2"]


def _run(name, nproc, components, extra, *, iters, load=None):
    flags = [*BASE, "--train-iters", str(iters), *extra,  # later flags win: extra may set --seq-length
             "--save-interval", "2", *(["--load-checkpoint", load] if load else [])]
    return finetune(name, nproc, flags, components=components)


@GROUP_RESUME
def test_resume_on_the_same_layout_is_bit_exact_and_loss_falls():
    """A resumed run repeats the continuous one's losses and gradient norms bit for bit, and its last
    checkpoint (weights; the distributed optimizer's sharded Adam state) equals the continuous run's,
    RNG streams restored (no notice), with per-module param groups (their own peak learning rates, no
    decay on norms and biases) and overlapped reduce-scatter and param gather over several language
    buckets: the resumed steps run on weights the forward pre-hooks gather."""
    cont = resume_continuous().out
    resumed, proc = finetune("resumed", 4, [*RESUME_FLAGS, "--load-checkpoint", cont + "/checkpoints/iter_0000004"],
                             components=NON_COLOCATED_4)
    a = {m["step"]: m for m in metrics(cont)}
    b = {m["step"]: m for m in metrics(resumed)}
    assert sorted(b) == [5, 6, 7, 8]
    for step in b:
        assert b[step]["loss"] == a[step]["loss"], step
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step
    assert RELAYOUT_NOTICE not in proc.stdout
    losses = [a[s]["loss"] for s in sorted(a)]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    for read in (checkpoint_tensors, optimizer_tensors):
        end_a, end_b = read(cont + "/checkpoints/iter_0000008"), read(resumed + "/checkpoints/iter_0000008")
        assert end_a and end_a.keys() == end_b.keys() and all(torch.equal(end_a[k], end_b[k]) for k in end_a), read
    # a checkpoint without the sharded optimizer state (an older mimo-sft's) is refused with a clear message
    old = new_dir("old_format") + "/iter_0000004"
    shutil.copytree(cont + "/checkpoints/iter_0000004", old, ignore=shutil.ignore_patterns("optimizer"))
    proc = finetune("relayout", 3, [*RESUME_FLAGS, "--load-checkpoint", old],
                    components=["language=dp=2", "images=dp=1,rank_offset=2"], check=False).proc
    assert proc.returncode != 0
    assert "no sharded optimizer state" in proc.stderr and "--pretrained-checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert "language=tp=1,pp=1,cp=1,dp=2,rank_offset=0" in proc.stderr  # the layout it can resume with


def test_plain_optimizer_resumes_on_another_layout():
    """The plain optimizer's checkpoint of 4 non-colocated ranks continues on 2 colocated ones."""
    extra = ["--no-use-distributed-optimizer"]
    cont4, _ = _run("relayout_cont4_plain", 4, FOUR, extra, iters=4)
    two, proc = _run("relayout_two_plain", 2, TWO["plain"], extra, iters=4, load=cont4 + "/checkpoints/iter_0000002")
    assert RELAYOUT_NOTICE in proc.stdout
    print(f"plain: relative loss differences {assert_continues(cont4, two, [3, 4])}")


@GROUP_RESUME
def test_distributed_optimizer_resumes_on_other_layouts():
    """The distributed optimizer's DP-only form: 4 ranks -> 2 (DP 2 -> 1); the reshardable form of a
    1-rank run (each DP rank's boxes, train.checkpoint.reshard): 1 -> 4 ranks, and 1 -> another TP."""
    # (a) 4 -> 2 ranks, from step 4 of the run resumed bit for bit above, stopped after step 6
    cont = resume_continuous().out
    two, proc = finetune("relayout_two_distributed", 2, [*RESUME_FLAGS, "--exit-interval", "6",
                                                         "--load-checkpoint", cont + "/checkpoints/iter_0000004"],
                         components=TWO["distributed"])
    assert RELAYOUT_NOTICE in proc.stdout
    diffs = {f"4->2 step {k}": v for k, v in assert_continues(cont, two, [5, 6]).items()}
    # (b) 1 rank -> 4 ranks, against the 1-rank continuous run (saved --save-reshardable, in several padded
    # gradient buckets: megatron's gathered form stored the state after the first one shifted)
    extra = ["--use-distributed-optimizer"]
    cont1, _ = _run("relayout_cont1_distributed", 1, ONE, [*extra, "--save-reshardable", "--ddp-bucket-size", "8000"],
                    iters=4)
    ckpt1 = cont1 + "/checkpoints/iter_0000002"
    four, proc = _run("relayout_four_distributed", 4, FOUR, extra, iters=4, load=ckpt1)
    assert RELAYOUT_NOTICE in proc.stdout
    diffs.update({f"1->4 step {k}": v for k, v in assert_continues(cont1, four, [3, 4]).items()})
    # (c) another TP: the reshardable form continues (the DP-only form is refused: test_checkpoint_info.py)
    tp2, proc = _run("relayout_tp2_distributed", 2, TP2, extra, iters=4, load=ckpt1)
    diffs.update({f"1->tp2 step {k}": v for k, v in assert_continues(cont1, tp2, [3, 4]).items()})
    print(f"distributed: relative loss differences {diffs}")
