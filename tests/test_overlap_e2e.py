"""Overlapped gradient reduction and parameter gather, and the step profiler, under torchrun (gloo, CPU).

Reference: the same run with ``--no-overlap-grad-reduce`` (one bucket reduced after backward, weights
gathered right after the optimizer step). With overlap on (small buckets, so the language model has
several), every step's loss and every parameter's reduced gradient must equal the reference (fp32,
1e-6), and so must the saved weights: with ``--overlap-param-gather`` the optimizer step leaves the
other ranks' shards to the next forward, so a save that skipped the gather would hold stale shards
(about lr off). A resume from an overlapped run's checkpoint (several language buckets, param gather
in the forward) continues it bit for bit: test_resume_relayout.py's same-layout test.

The trace of the profiled runs proves the overlap happened: the language DP reduction's collectives
are issued inside the ``language backward`` range with overlap, and only in ``gradient finalize`` without.

The vision module overlaps too, in bucket order (``parallel.megatron_patches.OrderedGradReduce``): an
encoder rank whose micro-batch has no image skips the encoder and starts all of its buckets at the
finalize, pairing the collectives its DP peer started during backward. The bridge corner data, one
micro-batch a step, covers a step where one encoder rank has images and the other none, one where
both have, and one where neither has.

Other layouts (language pp 2, tp 2, colocated fan-in/fan-out, LoRA with tp 2) run with overlap on by
default in test_train_e2e.py and test_lora_e2e.py against their single-process references.
"""

import glob
import json
import math

import pytest

from e2e_runs import GROUP_OVERLAP, assert_same_gradients, finetune
from train_helpers import bridge_corner_data, checkpoint_tensors, metrics

pytestmark = [pytest.mark.e2e, GROUP_OVERLAP]

BASE = ["--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--no-tensorboard", "--dataloader-type", "cyclic",
        "--seed", "7"]
NON_COLOCATED = ["--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--scalable-dp",
                 "--intra-microbatch-reorder", "--reorder-mode", "exchange"]  # exchange: a reorder wait of its own
#: parameters per language bucket: several buckets in the tiny model, none with an empty DP shard
SMALL_BUCKETS = ["--ddp-bucket-size", "8000"]
PROFILE = ["--profile-steps", "2:2", "--profile-ranks", "0,2"]  # rank 0: language dp 0; rank 2: images dp 0


def _run(name, nproc, args, iters, data=None):
    return finetune(name, nproc, [*BASE, "--train-iters", str(iters), "--save-grads", "{out}/grads", *args],
                    data=data).out


def _assert_same_steps(ref, got, steps, *, rel=1e-6):
    for step in steps:
        a, b = metrics(ref)[step - 1], metrics(got)[step - 1]
        assert a["step"] == b["step"] == step
        assert math.isclose(b["loss"], a["loss"], rel_tol=rel), (step, b["loss"], a["loss"])
        assert_same_gradients(ref, got, step=step, rel=rel)


def _assert_same_weights(ref_ckpt, got_ckpt, *, tol):
    a, b = checkpoint_tensors(ref_ckpt), checkpoint_tensors(got_ckpt)
    assert set(a) == set(b) and any(k.startswith("language_model") for k in a)
    for k in a:
        diff = (a[k].double() - b[k].double()).abs().max().item()
        assert diff <= tol, f"{k}: weights differ by {diff}"


def _trace(run_dir, rank):
    files = glob.glob(f"{run_dir}/profile/rank{rank}.*.pt.trace.json")
    assert len(files) == 1, files
    with open(files[0]) as fh:
        return json.load(fh)["traceEvents"]


def _ranges(events, name):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation" and e["name"] == name]


def _dp_reductions_in(events, name):
    """Gradient reductions (c10d reduce-scatter / all-reduce calls) issued inside the ``name`` ranges.

    The calls are the dispatcher's ``c10d::`` ops on the training thread, timed when issued; the
    ``gloo:`` events are timed when gloo's worker thread runs them, which on a loaded machine can be
    after the backward that issued them has ended."""
    spans = _ranges(events, name)
    ops = [e["ts"] for e in events if e.get("cat") == "cpu_op" and e.get("name", "").startswith("c10d::") and
           ("reduce_scatter" in e["name"] or "allreduce" in e["name"])]
    return sum(any(lo <= t <= hi for lo, hi in spans) for t in ops)


@pytest.fixture(scope="module")
def reference_non_colocated():
    return _run("ovl_off", 4, [*NON_COLOCATED, "--no-overlap-grad-reduce", *PROFILE, "--save-interval", "2"], iters=4)


def test_overlap_non_colocated_distributed_optimizer_equals_no_overlap(reference_non_colocated):
    """Language dp 2 with the distributed optimizer: overlapped reduce-scatter and param gather on by
    default. Steps 2 and 4 run on weights gathered by the forward pre-hooks (no save after steps 1 and 3);
    the checkpoints of steps 2 and 4 are written after an explicit gather."""
    ref = reference_non_colocated
    run = _run("ovl_on", 4, [*NON_COLOCATED, *SMALL_BUCKETS, *PROFILE, "--save-interval", "2"], iters=4)
    _assert_same_steps(ref, run, (1, 2, 3, 4))
    # Adam turns gradient differences of 1e-7 into updates that differ by ~1e-6 where a gradient entry is
    # near its epsilon; a stale shard would be a whole update (~lr = 1e-3) off
    for step in (2, 4):
        _assert_same_weights(f"{ref}/checkpoints/iter_{step:07d}", f"{run}/checkpoints/iter_{step:07d}", tol=1e-5)
    meta = json.load(open(f"{run}/checkpoints/iter_0000002/meta.json"))
    assert meta["language_ddp_bucket_size"] == 8000
    # the overlapped run's reductions start during the language backward; the reference's only after it
    on, off = _trace(run, 0), _trace(ref, 0)
    assert _dp_reductions_in(on, "language backward") > 0
    assert _dp_reductions_in(off, "language backward") == 0 and _dp_reductions_in(off, "gradient finalize") > 0


def test_profile_holds_exactly_the_steps_and_ranks_with_named_phases(reference_non_colocated):
    """--profile-steps 2:2 --profile-ranks 0,2: one chrome trace each for ranks 0 and 2, none for 1 and 3,
    holding step 2 only, with the step's phases as named ranges on each side of the bridge."""
    ref = reference_non_colocated
    assert sorted(glob.glob(f"{ref}/profile/*")) == sorted(glob.glob(f"{ref}/profile/rank[02].*.pt.trace.json"))
    language, images = _trace(ref, 0), _trace(ref, 2)
    for events in (language, images):
        steps = {e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step ")}
        assert steps == {"step 2"}, steps
        for name in ("data wait", "reorder wait", "bridge", "gradient finalize", "optimizer"):
            assert _ranges(events, name), name
    for name in ("language forward", "language backward"):
        assert len(_ranges(language, name)) == 2 and not _ranges(images, name), name  # 2 micro-batches
    for name in ("encoder forward", "encoder backward"):
        assert len(_ranges(images, name)) == 2 and not _ranges(language, name), name
    (step_lo, step_hi), = _ranges(language, "step 2")
    assert all(step_lo <= lo and hi <= step_hi for lo, hi in _ranges(language, "language backward"))


def test_overlap_colocated_lora_with_a_frozen_tower_equals_no_overlap():
    """Colocated language dp 2 with LoRA adapters (the plain optimizer: overlapped all-reduce, no param
    gather) and a fully frozen vision module (no buckets at all)."""
    args = ["--component", "language=dp=2", "--component", "images=dp=2", "--scalable-dp",
            "--lora-rank", "4", "--lora-alpha", "8", "--freeze-vision", "--freeze-projector", "--no-save"]
    ref = _run("ovl_lora_off", 2, [*args, "--no-overlap-grad-reduce"], iters=2)
    run = _run("ovl_lora_on", 2, [*args, "--ddp-bucket-size", "3000"], iters=2)
    _assert_same_steps(ref, run, (2,))
    assert math.isclose(metrics(run)[0]["loss"], metrics(ref)[0]["loss"], rel_tol=1e-6)


def test_vision_overlap_in_bucket_order_equals_no_overlap_when_encoder_ranks_have_no_images():
    """Images dp 2 in several buckets, one micro-batch of the bridge corner samples a step (read in
    order): step 1 images on encoder rank 2 only, step 2 on both, step 3 on neither. Every step's loss
    and reduced gradients equal the no-overlap run's; in step 1 rank 2 starts reductions inside its
    encoder backward, rank 3 (no image: the encoder is skipped) starts more of them in the finalize than
    the one bucket of the reference."""
    args = ["--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--scalable-dp",
            "--dataloader-type", "single", "--global-batch-size", "4", "--no-save",
            "--profile-steps", "1:1", "--profile-ranks", "2,3"]
    ref = _run("ovl_vision_off", 4, [*args, "--no-overlap-grad-reduce"], iters=3, data=bridge_corner_data())
    run = _run("ovl_vision_on", 4, [*args, *SMALL_BUCKETS], iters=3, data=bridge_corner_data())
    # bucketed reductions sum in another order: a tower gradient lands 1.2e-6 of its largest entry away (fp32)
    _assert_same_steps(ref, run, (1, 2), rel=2e-6)
    assert math.isclose(metrics(run)[2]["loss"], metrics(ref)[2]["loss"], rel_tol=1e-6)
    assert_same_gradients(ref, run, step=3, rel=1e-6, most_nonzero=False)  # text only: the tower's are 0
    on2, off2, on3, off3 = _trace(run, 2), _trace(ref, 2), _trace(run, 3), _trace(ref, 3)
    assert _dp_reductions_in(on2, "encoder backward") > 0 and _dp_reductions_in(off2, "encoder backward") == 0
    assert not _ranges(on3, "encoder backward")
    assert _dp_reductions_in(on3, "gradient finalize") > _dp_reductions_in(off3, "gradient finalize")


def test_vision_overlap_through_the_colocated_bridge_equals_no_overlap():
    """Colocated fan-in (language tp 2, images dp 2 on the same 2 ranks) in several vision buckets: an
    encoder rank without images runs the tower on zero rows for the bridge's gather, and the step
    without any image skips it on both. The bridge corner samples as above; every step equals the
    no-overlap run's."""
    args = ["--component", "language=tp=2,dp=1", "--component", "images=dp=2", "--scalable-dp",
            "--dataloader-type", "single", "--global-batch-size", "4", "--no-save"]
    ref = _run("ovl_cofanin_off", 2, [*args, "--no-overlap-grad-reduce"], iters=3, data=bridge_corner_data())
    run = _run("ovl_cofanin_on", 2, [*args, *SMALL_BUCKETS], iters=3, data=bridge_corner_data())
    _assert_same_steps(ref, run, (1, 2))
    assert math.isclose(metrics(run)[2]["loss"], metrics(ref)[2]["loss"], rel_tol=1e-6)
    assert_same_gradients(ref, run, step=3, rel=1e-6, most_nonzero=False)
