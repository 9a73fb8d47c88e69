"""DeepStack across megatron's bridges under torchrun (gloo, CPU): every layout's step equals the
single-process step of the tiny Qwen3-VL (4 language layers, DeepStack after layers 0 and 1).

The encoder's rows ``[main | deepstack_0 | deepstack_1]`` (3x the hidden size) cross megatron's
``BridgeCommunicator`` (non-colocated) or ``ColocatedBridgeCommunicator`` (colocated, padded by
``train.bridge`` where the DP sizes differ) and the language model adds the features after layers 0-1
(``model.deepstack``). Data: the bridge corner cases (``train_helpers.BRIDGE_CORNER_IMAGES``: a
text-only micro-batch, an encoder slice and a language slice without images, several image sizes
in one sample), one step of three micro-batches. Each run is compared with the single-process run
(loss, grad norm and every parameter's reduced gradient, fp32, relative 1e-5; the weights after the
Adam step to ``WEIGHTS_TOL``):

* non-colocated: language tp 2 x dp 2 fed by one encoder rank, with index-mode reordering,
  in-batch packing (THD), sequence parallelism, LoRA and full (uniform) recomputation -- against
  the single-process LoRA run;
* colocated fan-out (images tp 2 x dp 1 feeding language dp 2) with packing, balanced by the per-GPU
  plan (``data.reorder.colocated_plan``, the language term weighed in);
* colocated fan-in (images dp 2 feeding language tp 2 x dp 1) with sequence parallelism on padded
  rows and selective recomputation, balanced by the per-GPU plan (vision only);
* colocated equal DP (dp 2 both) at language tp 2 without sequence parallelism (the tower
  replicated on its tp ranks), with encoder-only balancing (``--encoder-balance``: images encoded on the
  other tower of the DP group, the DeepStack-wide rows and their gradients sent back);
* language pp 2 x dp 2 (the deepstack layers on stage 0) fed by one encoder rank, with exchange-mode
  reordering, packed, with full (block) recomputation: 1F1B runs a later micro-batch's forward
  before an earlier one's backward.
"""

import functools
import math
import tempfile
from pathlib import Path

import pytest

from e2e_runs import CORNER, GROUP_DEEPSTACK, SINGLE, assert_same_step, layout_run
from train_helpers import bridge_corner_data, metrics

pytestmark = [pytest.mark.e2e, GROUP_DEEPSTACK]

LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
PACKED = ["--in-batch-packing"]
#: weights after one Adam step: lr * g / (|g| + eps) turns a reduction-order difference of 4e-9 in a
#: gradient entry of 6e-8 (1e-6 of its tensor's largest, measured: colocated fan-in with sequence
#: parallelism, merger.linear_fc2) into 1.6e-5 of weight; the exactness claim is the per-parameter
#: gradient check (1e-5 relative), the weights only have to follow it to a tenth of one step (lr 1e-3)
WEIGHTS_TOL = 1e-4


@functools.lru_cache(maxsize=None)
def tiny_qwen3_vl() -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="mimo_sft_deepstack_")) / "tiny_qwen3_vl"
    return str(write_tiny_checkpoint(folder, seed=0, family="qwen3_vl", text_layers=4))


def run(name, nproc, components, extra=()):
    """One step of the corner-case data (three micro-batches) on the tiny Qwen3-VL, gradients saved."""
    return layout_run(name, nproc, components, bridge_corner_data(), [*CORNER, *extra], model=tiny_qwen3_vl())


@pytest.fixture(scope="module")
def reference():
    return run("ds_ref", 1, SINGLE)


def test_the_tiny_model_has_deepstack_on_two_layers():
    import json

    cfg = json.loads((Path(tiny_qwen3_vl()) / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl" and len(cfg["vision_config"]["deepstack_visual_indexes"]) == 2
    assert cfg["text_config"]["num_hidden_layers"] == 4


def test_non_colocated_tp2_sp_packing_reordering_lora_recompute():
    ref = run("ds_ref_lora", 1, SINGLE, LORA)
    got = run("ds_noncoloc", 5, ["language=tp=2,dp=2", "images=dp=1,rank_offset=4"],
              ["--scalable-dp", "--intra-microbatch-reorder", "--reorder-mode", "index", *PACKED,
               "--sequence-parallel", *LORA, "--recompute-granularity", "full", "--recompute-method", "uniform",
               "--recompute-num-layers", "1"])
    assert_same_step(ref, got, same_flops=False, weights_tol=WEIGHTS_TOL)
    assert metrics(got)[0]["padding_fraction"] == 0.0


BALANCED = ["--intra-microbatch-reorder", "--reorder-mode", "index"]


def _balanced(reference, got):
    """The reference's step, its loss at 1e-6 (the same samples as an unbalanced run, placed on other GPUs), and
    the per-GPU figures the progress line shows: the plan never leaves the heaviest GPU heavier."""
    assert math.isclose(metrics(got)[0]["loss"], metrics(reference)[0]["loss"], rel_tol=1e-6)
    m = metrics(got)[0]
    assert m["gpu_load_max_over_mean_after"] <= m["gpu_load_max_over_mean_before"], m


def test_colocated_fan_out_balanced_with_packing(reference):
    got = run("ds_co_fanout", 2, ["language=dp=2", "images=tp=2,dp=1"],
              ["--scalable-dp", *PACKED, *BALANCED, "--reorder-language-cost-weight", "1"])
    assert_same_step(reference, got, same_flops=False, weights_tol=WEIGHTS_TOL)
    _balanced(reference, got)


def test_colocated_fan_in_balanced_with_sequence_parallel_padded_rows_and_selective_recompute(reference):
    got = run("ds_co_fanin", 2, ["language=tp=2,dp=1", "images=dp=2"],
              ["--scalable-dp", "--sequence-parallel", "--recompute-granularity", "selective",
               "--recompute-modules", "core_attn,mlp", *BALANCED])
    assert_same_step(reference, got, weights_tol=WEIGHTS_TOL)
    _balanced(reference, got)


def test_colocated_equal_dp_at_language_tp2_without_sequence_parallelism(reference):
    """dp 2 both; every language tp rank holds the whole sequence and adds every row itself."""
    got = run("ds_co_equal", 4, ["language=tp=2,dp=2", "images=tp=2,dp=2"], ["--scalable-dp", "--encoder-balance"])
    assert_same_step(reference, got, weights_tol=WEIGHTS_TOL)
    # --encoder-balance: images went to the other tower of each tp rank's DP group, DeepStack rows came back
    assert metrics(got)[0]["encoder_balance_moved_images"] > 0


def test_language_pp2_exchange_reordering_packed_with_block_recompute(reference):
    got = run("ds_pp2", 5, ["language=pp=2,dp=2", "images=dp=1,rank_offset=4"],
              ["--scalable-dp", "--intra-microbatch-reorder", "--reorder-mode", "exchange", *PACKED,
               "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"])
    assert_same_step(reference, got, same_flops=False, weights_tol=WEIGHTS_TOL)
    assert math.isfinite(metrics(got)[0]["loss"])
