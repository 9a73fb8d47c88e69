"""End to end under torchrun (gloo, CPU): sequence parallelism equals tp 1, and activation
recomputation equals the same layout without it, per parameter.

* ``--sequence-parallel`` at language tp 2 against the single-process run (tp 1; loss, grad norm,
  every parameter's gradient and the weights after one step, fp32, 1e-5): non-colocated with
  reordering and packing (the packed length padded to a multiple of tp), and colocated (padded rows)
  with LoRA adapters (their sequence-parallel collectives).
* ``--recompute-*`` against the same run without recomputation (loss, grad norm and every gradient,
  relative 1e-6): full uniform + vision recompute on the sequence-parallel non-colocated run
  (reordering, packing, tp 2), selective + vision recompute on the colocated LoRA run, full block +
  vision recompute at language pp 2. Single-process cases (trained and frozen tower, LoRA dropout,
  every method) are in ``test_recompute.py``.

The single-process reference and the pp 2 run without recomputation are ``tests/e2e_runs.py``'s,
shared with test_train_e2e.py (where the pp 2 run is compared with the reference).
"""

import math

import pytest

from e2e_runs import (GROUP_LAYOUTS, PP2, SINGLE, assert_packed_equals_padded, assert_same_gradients, assert_same_step,
                      language_pp2, layout_run)
from e2e_runs import reference as single_process
from train_helpers import metrics

pytestmark = [pytest.mark.e2e, GROUP_LAYOUTS]

SP = ["--sequence-parallel"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
NON_COLOCATED_SP = (["language=tp=2,dp=2", "images=dp=1,rank_offset=4"],
                    ["--scalable-dp", "--intra-microbatch-reorder", "--in-batch-packing", *SP])
COLOCATED_SP = (["language=tp=2,dp=1", "images=dp=2"], ["--scalable-dp", *SP, *LORA])


def assert_recompute_equal(ref_dir, run_dir, *, rel=1e-6):
    """Loss, grad norm and every parameter's step-1 gradient equal the run without recomputation."""
    ref, got = metrics(ref_dir)[0], metrics(run_dir)[0]
    assert math.isclose(got["loss"], ref["loss"], rel_tol=rel), (got["loss"], ref["loss"])
    assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=rel), (got["grad_norm"], ref["grad_norm"])
    assert_same_gradients(ref_dir, run_dir, rel=rel)


@pytest.fixture(scope="module")
def reference():
    return single_process()


@pytest.fixture(scope="module")
def non_colocated_sp():
    return layout_run("sp_noncoloc", 5, NON_COLOCATED_SP[0], extra=NON_COLOCATED_SP[1])


@pytest.fixture(scope="module")
def colocated_sp_lora():
    return layout_run("sp_coloc_lora", 2, COLOCATED_SP[0], extra=COLOCATED_SP[1])


def test_sequence_parallel_non_colocated_with_reordering_and_packing_matches_tp1(reference, non_colocated_sp):
    assert_packed_equals_padded(reference, non_colocated_sp)


def test_sequence_parallel_colocated_with_lora_matches_tp1(colocated_sp_lora):
    ref = layout_run("mem_ref_lora", 1, SINGLE, extra=LORA)
    assert_same_step(ref, colocated_sp_lora)


def test_full_recompute_non_colocated_with_reordering_packing_and_sp(non_colocated_sp):
    run = layout_run("rc_noncoloc", 5, NON_COLOCATED_SP[0],
                     extra=[*NON_COLOCATED_SP[1], "--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1", "--recompute-vision"])
    assert_recompute_equal(non_colocated_sp, run)


def test_selective_recompute_colocated_tp2_with_lora(colocated_sp_lora):
    run = layout_run("rc_coloc_lora", 2, COLOCATED_SP[0],
                     extra=[*COLOCATED_SP[1], "--recompute-granularity", "selective", "--recompute-modules",
                            "core_attn,mlp", "--recompute-vision"])
    assert_recompute_equal(colocated_sp_lora, run)


def test_block_recompute_at_language_pp2():
    ref = language_pp2()
    run = layout_run("rc_pp2", 3, PP2, extra=["--recompute-granularity", "full", "--recompute-method", "block",
                                              "--recompute-num-layers", "1", "--recompute-vision"])
    assert_recompute_equal(ref, run)
