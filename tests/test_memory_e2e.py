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
"""

import math

import pytest

from test_train_e2e import assert_packed_equals_padded, assert_same_gradients, assert_same_step, run_layout
from train_helpers import demo_data, metrics

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]

SP = ["--sequence-parallel"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
NON_COLOCATED_SP = (["language=tp=2,dp=2", "images=dp=1,rank_offset=4"],
                    ["--scalable-dp", "--intra-microbatch-reorder", "--in-batch-packing", *SP])
COLOCATED_SP = (["language=tp=2,dp=1", "images=dp=2"], ["--scalable-dp", *SP, *LORA])
PP2 = ["language=pp=2,dp=1", "images=dp=1,rank_offset=2"]


def assert_recompute_equal(ref_dir, run_dir, *, rel=1e-6):
    """Loss, grad norm and every parameter's step-1 gradient equal the run without recomputation."""
    ref, got = metrics(ref_dir)[0], metrics(run_dir)[0]
    assert math.isclose(got["loss"], ref["loss"], rel_tol=rel), (got["loss"], ref["loss"])
    assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=rel), (got["grad_norm"], ref["grad_norm"])
    assert_same_gradients(ref_dir, run_dir, rel=rel)


@pytest.fixture(scope="module")
def reference():
    return run_layout("mem_ref", 1, ["language=dp=1", "images=dp=1"], demo_data())


@pytest.fixture(scope="module")
def non_colocated_sp():
    return run_layout("sp_noncoloc", 5, NON_COLOCATED_SP[0], demo_data(), NON_COLOCATED_SP[1])


@pytest.fixture(scope="module")
def colocated_sp_lora():
    return run_layout("sp_coloc_lora", 2, COLOCATED_SP[0], demo_data(), COLOCATED_SP[1])


def test_sequence_parallel_non_colocated_with_reordering_and_packing_matches_tp1(reference, non_colocated_sp):
    assert_packed_equals_padded(reference, non_colocated_sp)


def test_sequence_parallel_colocated_with_lora_matches_tp1(colocated_sp_lora):
    ref = run_layout("mem_ref_lora", 1, ["language=dp=1", "images=dp=1"], demo_data(), LORA)
    assert_same_step(ref, colocated_sp_lora)


def test_full_recompute_non_colocated_with_reordering_packing_and_sp(non_colocated_sp):
    run = run_layout("rc_noncoloc", 5, NON_COLOCATED_SP[0], demo_data(),
                     [*NON_COLOCATED_SP[1], "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1", "--recompute-vision"])
    assert_recompute_equal(non_colocated_sp, run)


def test_selective_recompute_colocated_tp2_with_lora(colocated_sp_lora):
    run = run_layout("rc_coloc_lora", 2, COLOCATED_SP[0], demo_data(),
                     [*COLOCATED_SP[1], "--recompute-granularity", "selective", "--recompute-modules", "core_attn,mlp",
                      "--recompute-vision"])
    assert_recompute_equal(colocated_sp_lora, run)


def test_block_recompute_at_language_pp2():
    ref = run_layout("rc_pp2_ref", 3, PP2, demo_data())
    run = run_layout("rc_pp2", 3, PP2, demo_data(), ["--recompute-granularity", "full", "--recompute-method", "block",
                                                     "--recompute-num-layers", "1", "--recompute-vision"])
    assert_recompute_equal(ref, run)
