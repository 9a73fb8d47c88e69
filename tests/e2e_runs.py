"""The end-to-end runs the tests share, and the comparisons the tests make on them.

A torchrun launch costs seconds of startup per rank before its first step, so a run that several
tests read is launched once per pytest worker: :func:`shared_run` keys a run by its whole command
line except its output folder, and the first test that asks for it launches it; every later test,
in its file or another, reads the same metrics, checkpoints and saved gradients. The named runs
below are the ones that serve claims of more than one test; each says which.

Tests that share a run must be in the same xdist group (the ``GROUP_*`` marks) so that ``--dist
loadgroup`` sends them to one worker; a test that lands on another worker still passes, launching
the run again there. Sharing never changes what a run computes for a claim: a flag that one reader
needs and another does not (``--export-hf``, a validation set) is one that leaves the training
steps unchanged, which a test of its own asserts bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import pytest

from train_helpers import checkpoint_tensors, demo_data, metrics, new_dir, tiny_model, torchrun

#: the single-process references and the layouts compared with them (tests/test_train_e2e.py,
#: test_memory_e2e.py, test_validation_e2e.py, test_reorder_index.py)
GROUP_LAYOUTS = pytest.mark.xdist_group("e2e_layouts")
#: resume on the same and on other layouts (tests/test_resume_relayout.py)
GROUP_RESUME = pytest.mark.xdist_group("e2e_resume")
#: runs that stop, are killed or are resumed in bf16 against one never-stopped run
#: (tests/test_stopping.py, test_checkpoint_kill.py, test_train_bf16.py)
GROUP_STOP = pytest.mark.xdist_group("e2e_stop")
#: a file whose tests read the module's own reference run (one group each, so the two workers can
#: take them in parallel)
GROUP_DEEPSTACK = pytest.mark.xdist_group("e2e_deepstack")
GROUP_LORA = pytest.mark.xdist_group("e2e_lora")
GROUP_OVERLAP = pytest.mark.xdist_group("e2e_overlap")
GROUP_QWEN35 = pytest.mark.xdist_group("e2e_qwen35")

#: one step on the demo data, padded rows (the references compute padded rows; packed runs turn
#: packing back on), a checkpoint after it
STEP = ["--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "1",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--no-tensorboard",
        "--save-interval", "1", "--dataloader-type", "cyclic", "--seed", "7", "--no-in-batch-packing"]
#: the corner-case data read in order, three micro-batches of 4 (see train_helpers.BRIDGE_CORNER_IMAGES)
CORNER = ["--dataloader-type", "single", "--global-batch-size", "12"]
SINGLE = ("language=dp=1", "images=dp=1")
NON_COLOCATED_4 = ("language=dp=2", "images=dp=2,rank_offset=2")
PACKED = ["--in-batch-packing"]


class Run(NamedTuple):
    out: str
    proc: object  # subprocess.CompletedProcess


def finetune(name: str, nproc: int, flags, *, components=(), model: str | None = None, data: str | None = None,
             env: dict | None = None, check: bool = True, timeout: float = 300) -> Run:
    """``finetune`` of ``model`` (default: the tiny Qwen2.5-VL) on ``data`` (default: the demo data)
    into a new folder ``name``; ``{out}`` in a flag stands for that folder."""
    out = new_dir(name)
    args = ["--hf-model", model or tiny_model(), "--dataset-path", data or demo_data(), "--output-dir", out,
            *(f.replace("{out}", out) for f in flags)]
    for c in components:
        args += ["--component", c]
    return Run(out, torchrun(nproc, args, extra_env=env, check=check, timeout=timeout))


_SHARED: dict = {}


def shared_run(name: str, nproc: int, flags, *, components=(), model: str | None = None,
               data: str | None = None, env: dict | None = None) -> Run:
    """:func:`finetune`, launched once per worker for each command line (``name`` is only the folder
    of the first launch). Readers must not write into the run's folder except through the
    idempotent caches of ``train_helpers`` (``model_full.pt``)."""
    key = (nproc, tuple(flags), tuple(components), model, data, tuple(sorted((env or {}).items())))
    if key not in _SHARED:
        _SHARED[key] = finetune(name, nproc, flags, components=components, model=model, data=data, env=env)
    return _SHARED[key]


def layout_run(name: str, nproc: int, components, data: str | None = None, extra=(), *,
               model: str | None = None) -> str:
    """One :data:`STEP` on ``components`` with every parameter's reduced gradient saved; shared."""
    return shared_run(name, nproc, [*STEP, "--save-grads", "{out}/grads", *extra], components=components,
                      data=data, model=model).out


# ---- runs that serve more than one test ------------------------------------------------------------

def reference() -> str:
    """Both modules on one rank: the step every layout of test_train_e2e.py and test_memory_e2e.py
    must reproduce; its checkpoint is the export and --pretrained-checkpoint source."""
    return layout_run("ref_var", 1, SINGLE)


#: clips take more tokens than the demo's receipts (test_context_parallel_e2e.py)
VIDEO = ["--seq-length", "256"]


@functools.lru_cache(maxsize=None)
def video_data() -> str:
    """16 samples of real clips (H.264 and VP9, a window, a frame list, a variable-rate stream), pages of very
    different sizes and text-only rows (``testing.clips``)."""
    from mimo_sft.testing.clips import write_video_dataset

    return str(write_video_dataset(new_dir("cp_video_data"), samples=16, seed=3))


def video_reference() -> str:
    """The tiny Qwen2.5-VL's padded single-process step on :func:`video_data`: test_context_parallel_e2e's
    reference."""
    return layout_run("cp_vid_ref", 1, SINGLE, video_data(), VIDEO)


#: non-colocated, vision load balanced by index-mode reordering (the default mode), data read in the
#: rank's own process, TensorBoard and an MFU peak on
REORDERED = ["--scalable-dp", "--intra-microbatch-reorder", "--num-workers", "0", "--tensorboard", "--peak-tflops",
             "0.5"]


def non_colocated_reordered() -> str:
    """Language and images dp 2 on their own ranks with :data:`REORDERED`: test_train_e2e's
    equal-DP test (same step as :func:`reference`, the metrics record, the start-up banner) and
    test_reorder_index's index-mode side (the same run in exchange mode must equal it bit for bit)."""
    return non_colocated_reordered_run().out


def non_colocated_reordered_run() -> Run:
    """:func:`non_colocated_reordered` with its torchrun output (the banner)."""
    return shared_run("equal", 4, [*STEP, "--save-grads", "{out}/grads", *REORDERED], components=NON_COLOCATED_4)


@functools.lru_cache(maxsize=None)
def valid_data() -> str:
    """A separate validation file: 10 samples (two full micro-batches of 4 and a filled one)."""
    from mimo_sft.testing.demo_data import write_demo_dataset

    return str(write_demo_dataset(new_dir("valid_10"), samples=10, seed=5))


def packed_non_colocated() -> str:
    """:func:`non_colocated_reordered`'s layout packed, evaluating a validation set before and after
    its step: test_train_e2e's packed test (same step as the padded :func:`reference`) and
    test_validation_e2e's non-colocated test (the one-process run's validation values). Evaluation
    leaves the training step bit-identical (test_validation_e2e.test_evaluation_leaves_training_bit_identical)."""
    return layout_run("packed_equal", 4, NON_COLOCATED_4,
                      extra=["--scalable-dp", "--intra-microbatch-reorder", *PACKED,
                             "--valid-dataset-path", valid_data(), "--eval-at-start"])


PP2 = ("language=pp=2,dp=1", "images=dp=1,rank_offset=2")


def language_pp2() -> str:
    """language pp 2 fed by its own encoder rank: test_train_e2e's pp 2 test and the no-recompute
    side of test_memory_e2e's block-recompute test."""
    return layout_run("pp2", 3, PP2)


COLOCATED_FAN_IN = ("language=tp=2,dp=1", "images=dp=2")


def colocated_fan_in() -> str:
    """Encoder dp 2 feeding language tp 2 on the same ranks, exported at the end (``--export-hf``,
    written after training): test_train_e2e's fan-in test and its --export-hf test."""
    return layout_run("co_fanin", 2, COLOCATED_FAN_IN, extra=["--scalable-dp", "--export-hf", "{out}/hf"])


#: 8 steps with warmup and cosine decay, per-module param groups, the distributed optimizer with
#: overlapped reduce-scatter and param gather in several language buckets, reordering
RESUME_FLAGS = ["--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2e-3",
                "--lr-warmup-iters", "2", "--train-iters", "8", "--no-tensorboard", "--scalable-dp",
                "--dataloader-type", "cyclic", "--intra-microbatch-reorder", "--use-distributed-optimizer",
                "--vision-lr", "4e-3", "--projector-lr", "1e-3", "--weight-decay", "0.05", "--ddp-bucket-size", "8000"]


def resume_continuous() -> Run:
    """4 ranks, 8 steps, checkpoints at 4 and 8: the run test_resume_relayout.py resumes on the same
    layout (bit for bit) and on 2 ranks (to reduction order)."""
    return shared_run("continuous", 4, [*RESUME_FLAGS, "--save-interval", "4"], components=NON_COLOCATED_4)


def stop_args(iters: int, components=SINGLE) -> list[str]:
    """The stopping and kill tests' run (without its folder): seq 160, 4 samples a step, constant lr."""
    return ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--seq-length", "160", "--micro-batch-size",
            "2", "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "3e-3", "--lr-decay-style",
            "constant", "--dataloader-type", "cyclic", "--no-tensorboard",
            *[a for c in components for a in ("--component", c)]]


@functools.lru_cache(maxsize=None)
def never_stopped() -> str:
    """1 rank, 6 steps, checkpoints at 2, 4 and 6, never stopped or killed: the losses every
    stopped, killed and resumed run of test_stopping.py and test_checkpoint_kill.py must repeat,
    and (trained well away from the HF weights) test_train_bf16's --pretrained-checkpoint source."""
    out = new_dir("kill_reference")
    torchrun(1, [*stop_args(6), "--save-interval", "2", "--output-dir", out])
    return out


# ---- comparisons ------------------------------------------------------------------------------------

def train_rows(run_dir: str) -> list[dict]:
    """metrics.jsonl's training rows (an evaluation writes rows of its own, with ``valid_loss``)."""
    return [r for r in metrics(run_dir) if "loss" in r]


#: what a run resumed on another layout prints (RNG streams are per rank and layout)
RELAYOUT_NOTICE = "resuming on another layout: RNG streams restart from the seed"


def assert_continues(cont, resumed, steps, rel=1e-5) -> dict:
    """The resumed run's ``steps`` have the continuous run's loss and grad norm (relative ``rel``: the
    reduction order of another layout) and data position; returns the relative loss differences."""
    a = {m["step"]: m for m in train_rows(cont)}
    b = {m["step"]: m for m in train_rows(resumed)}
    assert sorted(b) == steps
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert math.isclose(b[step][key], a[step][key], rel_tol=rel), (step, key, b[step][key], a[step][key])
        assert b[step]["consumed_samples"] == a[step]["consumed_samples"]
    return {s: abs(b[s]["loss"] - a[s]["loss"]) / a[s]["loss"] for s in steps}


def assert_same_gradients(ref_dir, run_dir, *, step=1, rel=1e-5, most_nonzero=True, loose: dict | None = None) -> dict:
    """Every parameter's reduced gradient of ``step`` (``--save-grads``: after the DP reduction and
    the token scale, before clipping) equals the reference's, relative to the tensor's largest
    entry. Unlike weights after one Adam step (about -lr * sign(grad)), this sees a gradient that is
    off by a constant factor. ``loose``: {name suffix: tolerance} for parameters whose fp32 gradient is
    noisier than ``rel`` in any two summation orders (say why where it is passed). Returns the
    reference's gradients."""
    a = checkpoint_tensors(f"{ref_dir}/grads/iter_{step:07d}")
    b = checkpoint_tensors(f"{run_dir}/grads/iter_{step:07d}")
    assert set(a) == set(b) and a
    nonzero = 0
    for k in a:
        scale = a[k].abs().max().item()
        diff = (a[k].double() - b[k].double()).abs().max().item()
        tol = next((t for suffix, t in (loose or {}).items() if k.endswith(suffix)), rel)
        assert diff <= tol * scale + 1e-12, f"step {step} {k}: gradient differs by {diff} (largest entry {scale})"
        nonzero += scale > 0
    if most_nonzero:
        assert nonzero > len(a) // 2, f"step {step}: most parameters should have a gradient"
    return a


def assert_same_step(ref_dir, run_dir, *, weights_tol=1e-5, same_flops=True, loose: dict | None = None):
    """Step 1 of ``run_dir`` is the reference's: loss, grad norm, model FLOPs, every parameter's
    gradient and the weights after the step."""
    ref, got = train_rows(ref_dir)[0], train_rows(run_dir)[0]
    assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5), (got["loss"], ref["loss"])
    assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=1e-5), (got["grad_norm"], ref["grad_norm"])
    # every sample's model FLOPs counted on exactly one rank: the step's total is layout-free
    # (a packed run computes fewer positions than a padded reference: same_flops=False)
    if same_flops:
        assert math.isclose(got["model_flops"], ref["model_flops"], rel_tol=1e-12), \
            (got["model_flops"], ref["model_flops"])
    assert_same_gradients(ref_dir, run_dir, loose=loose)
    a = checkpoint_tensors(ref_dir + "/checkpoints/iter_0000001")
    b = checkpoint_tensors(run_dir + "/checkpoints/iter_0000001")
    assert set(a) == set(b)
    enc = [k for k in a if "modality_submodules" in k]
    lang = [k for k in a if k.startswith("language_model")]
    assert enc and lang
    for k in a:
        diff = (a[k].float() - b[k].float()).abs().max().item()
        assert diff <= weights_tol, f"{k}: max abs diff {diff}"


def assert_packed_equals_padded(ref_dir, run_dir, *, weights_tol=1e-5):
    """Same loss, grad norm, per-parameter gradients and weights as the padded reference; the packed
    run computes no padding and fewer model FLOPs (it skips the pads the reference computed)."""
    assert_same_step(ref_dir, run_dir, same_flops=False, weights_tol=weights_tol)
    ref, got = train_rows(ref_dir)[0], train_rows(run_dir)[0]
    assert got["padding_fraction"] == 0.0 and ref["padding_fraction"] > 0.3, (got, ref)
    assert got["model_flops"] < ref["model_flops"]
