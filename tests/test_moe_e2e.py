"""Qwen3-VL-MoE under torchrun (gloo, CPU): every expert-parallel layout's step equals the single-process
step of the tiny Qwen3-VL-MoE (8 experts, top 2, four sparse layers; DeepStack after the first two), per
parameter.

Data: the bridge corner cases (``train_helpers.BRIDGE_CORNER_IMAGES``: text-only micro-batches, so a
language rank's slice without images still joins every expert all-to-all, encoder slices without
images, several image sizes in one sample), one step of three micro-batches. Compared with the
single-process padded run: loss, grad norm, every parameter's reduced gradient (each expert's and the
routers' included) at 1e-5 of its largest entry, the weights after the Adam step.

* non-colocated: language dp 2 x ep 2 (each rank holds 4 of the 8 experts; tokens cross ranks in the
  alltoall dispatcher) fed by one encoder rank, index-mode reordering, in-batch packing;
* colocated: language tp 2 x dp 2 with ep 2 and etp 2 (each expert's fc1/fc2 split over tp as well),
  sequence parallelism, images dp 4 fan-in;
* language pp 2 x dp 2 x ep 2, non-colocated;
* resume: a run stopped after step 1 and resumed continues as the continuous one; and onto ep 1.
"""

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from e2e_runs import (CORNER, RELAYOUT_NOTICE, SINGLE, assert_continues, assert_same_step, finetune, layout_run,
                      train_rows)
from train_helpers import bridge_corner_data, checkpoint_tensors, metrics, optimizer_tensors

GROUP_MOE = pytest.mark.xdist_group("e2e_moe")
pytestmark = [pytest.mark.e2e, GROUP_MOE]

WEIGHTS_TOL = 1e-4
PACKED = ["--in-batch-packing"]


@functools.lru_cache(maxsize=None)
def tiny_moe() -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="mimo_sft_moe_")) / "tiny_qwen3_vl_moe"
    return str(write_tiny_checkpoint(folder, seed=0, family="qwen3_vl_moe", text_layers=4))


def run(name, nproc, components, extra=()):
    return layout_run(name, nproc, components, bridge_corner_data(), [*CORNER, *extra], model=tiny_moe())


@pytest.fixture(scope="module")
def reference():
    return run("moe_ref", 1, SINGLE)


def test_non_colocated_ep2_dp2_reordering_packing(reference):
    got = run("moe_noncoloc", 3, ["language=dp=2,ep=2", "images=dp=1,rank_offset=2"],
              ["--scalable-dp", "--intra-microbatch-reorder", "--reorder-mode", "index", *PACKED])
    assert_same_step(reference, got, same_flops=False, weights_tol=WEIGHTS_TOL)
    # padding positions are routed (and computed by the experts) too: the packed run's load is the
    # packed single process's
    _same_expert_load(run("moe_ref_packed", 1, SINGLE, PACKED), got)


def _same_expert_load(ref_dir, run_dir):
    """Tokens per expert are a property of the step, not of the layout: every layer's max/mean figure
    equals the single process's (counted over dp, de-duplicated over tp, gathered over pp stages)."""
    a, b = train_rows(ref_dir)[0], train_rows(run_dir)[0]
    keys = sorted(k for k in a if k.startswith("moe_load_max_over_mean"))
    assert len(keys) == 1 + 4 and a["moe_load_max_over_mean"] > 1.0, a
    assert all(abs(a[k] - b[k]) <= 1e-9 * a[k] for k in keys), {k: (a[k], b[k]) for k in keys}


def test_colocated_tp2_ep2_etp2_sequence_parallel_fan_in(reference):
    got = run("moe_coloc", 4, ["language=tp=2,dp=2,ep=2", "images=dp=4"], ["--sequence-parallel"])
    assert_same_step(reference, got, weights_tol=WEIGHTS_TOL)
    _same_expert_load(reference, got)


def test_language_pp2_dp2_ep2(reference):
    got = run("moe_pp2", 5, ["language=pp=2,dp=2,ep=2", "images=dp=1,rank_offset=4"])
    assert_same_step(reference, got, weights_tol=WEIGHTS_TOL)
    _same_expert_load(reference, got)


#: 4 steps of 4 samples, checkpoints at 2 and 4, the experts' optimizer state saved in the form that
#: resumes on another expert layout
RESUME = ["--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "4",
          "--lr", "2e-3", "--lr-warmup-iters", "1", "--no-tensorboard", "--dataloader-type", "cyclic", "--seed", "7",
          "--save-interval", "2", "--save-reshardable", "--scalable-dp", "--intra-microbatch-reorder"]
EP2 = ["language=dp=2,ep=2", "images=dp=1,rank_offset=2"]


def _resume_run(name, nproc, components, load=None, extra=()):
    return finetune(name, nproc, [*RESUME, *(["--load-checkpoint", load] if load else []), *extra],
                    components=components, model=tiny_moe(), data=bridge_corner_data())


@pytest.fixture(scope="module")
def continuous():
    return _resume_run("moe_cont", 3, EP2).out


def test_resume_with_ep_is_bit_exact(continuous):
    """Resumed at step 2 on the same ep 2 layout: steps 3-4 repeat the continuous run bit for bit, and the
    final weights and sharded Adam state (each rank's experts) equal the continuous run's. Resumed with
    --train-iters 6, it keeps the checkpoint's cosine schedule (warm-up 1, decay over 4 steps: steps 3-4 at the
    continuous run's learning rates) and steps 5-6 stay at --min-lr (issue 55 item 5)."""
    resumed, proc = _resume_run("moe_resumed", 3, EP2, load=continuous + "/checkpoints/iter_0000002",
                                extra=["--train-iters", "6"])
    a = {m["step"]: m for m in metrics(continuous)}
    b = {m["step"]: m for m in metrics(resumed)}
    assert sorted(b) == [3, 4, 5, 6]
    assert all(b[s]["loss"] == a[s]["loss"] and b[s]["grad_norm"] == a[s]["grad_norm"] and b[s]["lr"] == a[s]["lr"]
               for s in (3, 4)), (a, b)
    assert b[5]["lr"] == b[6]["lr"] == 0.0 < b[4]["lr"]
    assert ("mimo-sft: LR schedule from the checkpoint: warm-up 1, decay over 4 steps; steps 5-6 stay at --min-lr 0 "
            "(--lr-decay-iters 6 re-stretches it)") in proc.stdout, proc.stdout
    assert RELAYOUT_NOTICE not in proc.stdout
    for read in (checkpoint_tensors, optimizer_tensors):
        end_a, end_b = read(continuous + "/checkpoints/iter_0000004"), read(resumed + "/checkpoints/iter_0000004")
        assert end_a and end_a.keys() == end_b.keys() and all((end_a[k] == end_b[k]).all() for k in end_a), read
    # megatron stores a layer's experts as one [experts, ...] tensor per linear: all 8, gathered across ep
    experts = {k: v for k, v in checkpoint_tensors(continuous + "/checkpoints/iter_0000004").items()
               if ".mlp.experts.experts.linear_fc" in k}
    assert len(experts) == 4 * 2 and all(v.shape[0] == 8 for v in experts.values()), {k: v.shape for k, v in experts.items()}


def test_resume_from_ep2_onto_ep1(continuous):
    """The ep 2 checkpoint continues on ep 1 (each language rank now holds all 8 experts) with the
    continuous run's losses and gradient norms, to the reduction order of the other layout."""
    resumed, proc = _resume_run("moe_ep1", 3, ["language=dp=2", "images=dp=1,rank_offset=2"],
                                load=continuous + "/checkpoints/iter_0000002")
    assert RELAYOUT_NOTICE in proc.stdout
    assert_continues(continuous, resumed, [3, 4])
    # back onto ep 2 from the ep 1 checkpoint: megatron keeps the experts' optimizer apart there, which the
    # ep 1 state does not have; refused before step 0, in one line
    proc = finetune("moe_back_to_ep2", 3, [*RESUME, "--load-checkpoint", resumed + "/checkpoints/iter_0000004"],
                    components=EP2, model=tiny_moe(), data=bridge_corner_data(), check=False).proc
    assert proc.returncode != 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if "etp=1 (the experts' optimizer state with the dense" in ln]
    assert line and "resume with ep=1 and etp=tp, or start from its weights with --pretrained-checkpoint" in line[0]


def test_load_balancing_loss_is_off_by_default_and_reported_when_on(reference):
    """--moe-aux-loss-coeff: off by default (no figure; the gradients above equal transformers' model, which
    adds none); on, megatron's per-layer loss is reported and moves only the gradients of the routers
    (and what is below them), not the logged language-model loss."""
    on = run("moe_aux", 1, SINGLE, ["--moe-aux-loss-coeff", "0.1"])
    off_row, on_row = train_rows(reference)[0], train_rows(on)[0]
    assert "moe_aux_loss" not in off_row and 1.0 <= on_row["moe_aux_loss"] < 4, on_row  # 1: balanced, E/k = 4
    assert on_row["loss"] == off_row["loss"]
    # a small coefficient moves the gradient a little (megatron's own scaling here moved the grad norm 4000x)
    assert abs(on_row["grad_norm"] - off_row["grad_norm"]) < 0.5 * off_row["grad_norm"], (on_row, off_row)
    a = checkpoint_tensors(f"{reference}/grads/iter_0000001")
    b = checkpoint_tensors(f"{on}/grads/iter_0000001")
    routers = [k for k in a if k.endswith("mlp.router.weight")]
    assert len(routers) == 4 and all((a[k] - b[k]).abs().max() > 1e-4 * a[k].abs().max() for k in routers)
    head = [k for k in a if k.endswith("output_layer.weight") or k.endswith("final_layernorm.weight")]
    assert head and all(torch.equal(a[k], b[k]) for k in head)  # above every router: untouched


def test_load_balancing_loss_at_sequence_parallel_tp2_equals_one_process():
    """With sequence parallelism each tp rank routes a slice of the positions: the loss's sums are added over tp,
    so the step (the routers' gradients included) and the reported loss are one process's. Before, each slice
    took its own Switch loss: the loss matched here but the gradient norm was 0.13% off."""
    aux = ["--moe-aux-loss-coeff", "0.1"]
    ref = run("moe_aux", 1, SINGLE, aux)  # shared with the test above
    got = run("moe_aux_sp", 2, ["language=tp=2,dp=1", "images=dp=2"], ["--sequence-parallel", *aux])
    assert_same_step(ref, got, weights_tol=WEIGHTS_TOL)
    a, b = train_rows(ref)[0]["moe_aux_loss"], train_rows(got)[0]["moe_aux_loss"]
    assert abs(a - b) <= 1e-6 * a, (a, b)


@functools.lru_cache(maxsize=None)
def tiny_qwen3_5_moe() -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="mimo_sft_q35moe_")) / "tiny_qwen3_5_moe"
    return str(write_tiny_checkpoint(folder, seed=0, family="qwen3_5_moe", text_layers=4))


#: the GDN decay path's fp32 gradient noise (tests/test_qwen3_5_e2e.py: DECAY)
DECAY = {"self_attention.A_log": 1e-3, "self_attention.dt_bias": 1e-3, "self_attention.in_proj.weight": 1e-4}


def test_qwen3_5_moe_ep2_dp2_non_colocated_reordering_packing():
    """Qwen3.5-MoE (hybrid GDN decoder, sparse MLPs with a gated shared expert): language dp 2 x ep 2 fed by
    one encoder rank, index reordering, packing (the GDN's conv and state restart per packed sample) against
    the single-process step, per parameter."""
    def q35(name, nproc, components, extra=()):
        return layout_run(name, nproc, components, bridge_corner_data(), [*CORNER, *extra], model=tiny_qwen3_5_moe())

    ref = q35("q35moe_ref", 1, SINGLE)
    got = q35("q35moe_noncoloc", 3, ["language=dp=2,ep=2", "images=dp=1,rank_offset=2"],
              ["--scalable-dp", "--intra-microbatch-reorder", "--reorder-mode", "index", *PACKED])
    assert_same_step(ref, got, same_flops=False, weights_tol=WEIGHTS_TOL, loose=DECAY)


def test_export_of_an_ep2_checkpoint_holds_every_expert_where_transformers_reads_it(continuous, tmp_path):
    """``mimo-sft export`` of the ep 2 run's checkpoint (each rank held 4 of the 8 experts): every expert's
    trained fc1/fc2 lands in transformers' fused tensors at its own index, and transformers loads the folder."""
    import subprocess
    import sys

    from transformers import AutoModelForImageTextToText

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint",
                           continuous + "/checkpoints/iter_0000004", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = checkpoint_tensors(continuous + "/checkpoints/iter_0000004")
    hf = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for layer in range(4):
        fc1 = ckpt[f"language_model.decoder.layers.{layer}.mlp.experts.experts.linear_fc1.weight"]  # [8, 2I, h]
        fc2 = ckpt[f"language_model.decoder.layers.{layer}.mlp.experts.experts.linear_fc2.weight"]  # [8, h, I]
        p = f"model.language_model.layers.{layer}.mlp.experts."
        assert torch.equal(hf[p + "gate_up_proj"], fc1.float()) and torch.equal(hf[p + "down_proj"], fc2.float())


@pytest.mark.parametrize("kind", ["model_metadata", "optimizer_metadata", "optimizer_object", "rank_file"])
def test_a_planted_ep2_checkpoint_is_refused_by_every_reader(continuous, kind, tmp_path):
    """The ep 2 checkpoint (experts split over two ranks, their optimizer state apart) with a payload in one
    file a load reads: ``checkpoint info --verify``, a 3-rank resume and (model/'s metadata) the export
    refuse it in one line, running nothing (train.checkpoint.trusted)."""
    from checkpoint_payloads import assert_refused, planted
    from train_helpers import python_m

    folder, marker, refused = planted(continuous + "/checkpoints/iter_0000002", tmp_path, kind)
    assert_refused(python_m(["checkpoint", "info", "--verify", folder]), refused, marker)
    if kind in ("optimizer_metadata", "rank_file"):  # each rank reads both (its own rank file: rank 0's here)
        proc = finetune(f"moe_planted_{kind}", 3, [*RESUME, "--load-checkpoint", folder],
                        components=EP2, model=tiny_moe(), data=bridge_corner_data(), check=False).proc
        assert_refused(proc, refused, marker, code=None)
    if kind == "model_metadata":
        proc = python_m(["export", "--checkpoint", folder, "--out", str(tmp_path / "hf")])
        assert_refused(proc, refused, marker)
