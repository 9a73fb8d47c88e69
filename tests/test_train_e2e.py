"""End to end under torchrun (gloo, CPU): exact gradients for every layout, reorder invariance,
exports, and a failing rank that ends the job with a clear error instead of a hang.

Reference: a single-process run (both modules on one rank, DP 1) on the same global batch. After
one step, every layout must reproduce its gradient norm and its weights. The runs that other files
read too (the reference, the reordered and packed non-colocated runs, language pp 2, colocated
fan-in) are ``tests/e2e_runs.py``'s; resume (bit for bit, falling loss): test_resume_relayout.py.
"""

import json
import math
import os

import pytest

from e2e_runs import (CORNER, GROUP_LAYOUTS, NON_COLOCATED_4, PACKED, SINGLE, STEP, assert_packed_equals_padded,
                      assert_same_step, colocated_fan_in, language_pp2, layout_run, non_colocated_reordered,
                      non_colocated_reordered_run, packed_non_colocated, reference, train_rows)
from train_helpers import (BRIDGE_CORNER_IMAGES, bridge_corner_data, checkpoint_tensors, demo_data, fixed_size_data,
                           metrics, new_dir, tiny_model, torchrun)

pytestmark = [pytest.mark.e2e, GROUP_LAYOUTS]


@pytest.fixture(scope="module")
def reference_variable():
    return reference()


@pytest.fixture(scope="module")
def reference_corner():
    assert len(BRIDGE_CORNER_IMAGES) == 12
    return layout_run("ref_corner", 1, SINGLE, bridge_corner_data(), CORNER)


def test_equal_dp_non_colocated_with_reordering_matches_single_process(reference_variable):
    run = non_colocated_reordered()
    assert_same_step(reference_variable, run)
    m = metrics(run)[0]
    assert m["vision_load_max_over_mean_after"] <= m["vision_load_max_over_mean_before"]
    from mimo_sft.train.metrics import StepMetrics
    from mimo_sft.train.startup import PARTS

    keys = StepMetrics.json_keys(["language", "images"])  # the record's fields, per-module peaks flattened
    # then the straggler report's per-rank figures at a log step (tests/test_straggler.py)
    keys += ["rank_step_s", "rank_work_s", "rank_phase_s", "rank_patches", "rank_tokens", "slowest_rank",
             "slowest_excess", "slowest_phase"]
    startup = ["startup_s", *(f"startup_{p}_s" for p in PARTS), "startup_rank"]  # the first row only
    assert list(m) == keys + startup and all(m[k] is not None for k in keys + startup), m
    _assert_startup(m, non_colocated_reordered_run().proc.stdout)
    assert len(m["rank_work_s"]) == 4 and 0 <= m["slowest_rank"] < 4
    # the work each rank was given: language ranks 0-1 their tokens, encoder ranks 2-3 their patches, only
    assert m["rank_patches"][:2] == [0.0, 0.0] and min(m["rank_patches"][2:]) > 0, m["rank_patches"]
    assert m["rank_tokens"][2:] == [0.0, 0.0] and min(m["rank_tokens"][:2]) > 0, m["rank_tokens"]
    assert m["tokens_per_s"] > 0 and m["peak_memory_bytes"] > 0 and m["reorder_exchange_s"] >= 0
    assert m["peak_memory_bytes"] == max(m["peak_memory_bytes_language"], m["peak_memory_bytes_images"])
    assert m["model_tflops_per_gpu"] == m["model_flops"] / m["step_time_s"] / 4 / 1e12
    assert math.isclose(m["mfu"], m["model_tflops_per_gpu"] / 0.5, rel_tol=1e-12)
    assert metrics(reference_variable)[0]["mfu"] is None  # no --peak-tflops and no GPU: unknown peak
    events = [f for f in os.listdir(os.path.join(run, "tensorboard")) if f.startswith("events.out.tfevents")]
    assert events and os.path.isfile(os.path.join(run, "config.yaml"))


def _assert_startup(row: dict, stdout: str) -> None:
    """The first row's start-up figures: every part timed and non-negative, the parts within the total, of the
    slowest of the 4 ranks; the banner says the same in one line."""
    from mimo_sft.train.startup import PARTS, StartupClock

    parts = [row[f"startup_{p}_s"] for p in PARTS]
    assert min(parts) >= 0 and sum(parts) <= row["startup_s"] + 1e-3 * len(parts), row  # each rounded to 1 ms
    assert row["startup_imports_s"] > 0 and row["startup_model_s"] > 0 and row["startup_data_s"] > 0, row
    assert row["startup_resume_s"] == 0 and 0 <= row["startup_rank"] < 4, row
    (line,) = [x for x in stdout.splitlines() if x.startswith("mimo-sft: start-up ")]
    assert line == f"mimo-sft: {StartupClock.line_of(row)} (rank {row['startup_rank']}, the slowest of 4)", line
    assert all(f"{name} " in line for name in ("imports", "groups", "model", "optimizer", "data", "first batch"))


def _from_the_reference(reference_variable):
    """1 rank and 4 non-colocated ranks (no reordering) started from the reference's checkpoint."""
    ckpt = reference_variable + "/checkpoints"
    single = layout_run("pre_single", 1, SINGLE, extra=["--pretrained-checkpoint", ckpt])
    multi = layout_run("pre_multi", 4, NON_COLOCATED_4, extra=["--pretrained-checkpoint", ckpt, "--scalable-dp"])
    return single, multi


def test_reordering_off_gives_same_step_one(reference_variable):
    """dp 2 / dp 2 on their own ranks without reordering: the single process's step (loss, grad norm,
    FLOPs, every gradient, the weights), both started from the reference's trained weights."""
    single, multi = _from_the_reference(reference_variable)
    assert_same_step(single, multi)
    assert metrics(multi)[0]["vision_load_max_over_mean_after"] is None


def test_fan_in_non_colocated_matches_single_process(reference_variable):
    # without --scalable-dp: every rank reads the whole micro-batch and keeps its part
    run = layout_run("fanin", 3, ["language=dp=2", "images=dp=1,rank_offset=2"])
    assert_same_step(reference_variable, run)


def test_colocated_fan_in_matches_single_process(reference_variable):
    """Encoder DP 2 feeding language tp 2, dp 1 on the same ranks, on mixed image sizes, multi-image
    and text-only samples (the bridge pads each sample's encoder output to one length)."""
    assert_same_step(reference_variable, colocated_fan_in())


#: colocated equal DP with encoder-only balancing (train.encoder_balance): images encoded on the other tower
CO_EQUAL = ["--scalable-dp", "--encoder-balance"]


def test_colocated_equal_dp_matches_single_process(reference_variable):
    """With --encoder-balance: images move to the other tower and their embeddings and gradients come back,
    and every parameter's gradient is still the single process's."""
    run = layout_run("co_equal", 2, ["language=dp=2", "images=dp=2"], extra=CO_EQUAL)
    assert_same_step(reference_variable, run)
    m = metrics(run)[0]
    assert m["encoder_balance_moved_images"] > 0, m
    assert m["encoder_balance_max_over_mean_after"] < m["encoder_balance_max_over_mean_before"], m


def _balanced_like_unbalanced(reference, on, off):
    """Balancing on: the reference's step (every gradient), the unbalanced run's loss at 1e-6 (the
    same samples, placed on other GPUs), and a vision load spread no wider than before -- strictly
    narrower on this data, so samples did move."""
    assert_same_step(reference, on)
    assert math.isclose(train_rows(on)[0]["loss"], train_rows(off)[0]["loss"], rel_tol=1e-6)
    m, m_off = metrics(on)[0], metrics(off)[0]
    assert m["vision_load_max_over_mean_after"] < m["vision_load_max_over_mean_before"], m
    assert m_off["vision_load_max_over_mean_after"] is None
    # the progress line's per-GPU figures (the plan's), and none without a plan
    assert m["gpu_load_max_over_mean_after"] < m["gpu_load_max_over_mean_before"], m
    assert "gpu_load_max_over_mean_before" not in m_off
    # the work each rank was given (the calibration's x): the same samples in both runs, moved between ranks;
    # the tokens over language tp add up to the step's real tokens, which the loss all-reduce counts apart
    # (the other run balances the towers' work by moving images, --encoder-balance: its rank_patches count what
    # each tower encoded, which sample placement's slices here equal)
    assert math.isclose(sum(m["rank_patches"]), sum(m_off["rank_patches"]), rel_tol=1e-9)
    if "encoder_balance_moved_images" in m_off:  # --encoder-balance moved images: the counts may coincide
        assert m_off["encoder_balance_moved_images"] > 0, m_off
    else:  # the other run kept its shards: sample placement changed what each tower encoded
        assert m["rank_patches"] != m_off["rank_patches"], (m["rank_patches"], m_off["rank_patches"])
    real = m["tokens_per_s"] * m["step_time_s"]
    assert math.isclose(sum(m["rank_tokens"]), real, rel_tol=1e-6), (m["rank_tokens"], real)
    # and the weights a later run takes from it (--reorder-calibrate-from), as validate shows them
    from mimo_sft.config.calibration import calibrate

    c = calibrate(on)
    assert c.encoder.per_unit_s > 0 and c.language.per_unit_s > 0 and c.language_weight > 0, c


def test_colocated_equal_dp_balanced_matches_single_process(reference_variable):
    """--intra-microbatch-reorder on colocated equal DP (index mode, the per-GPU plan of
    data.reorder.colocated_plan): each rank reads its balanced shard and splits it as before."""
    on = layout_run("co_equal_reorder", 2, ["language=dp=2", "images=dp=2"],
                    extra=["--scalable-dp", "--intra-microbatch-reorder"])
    off = layout_run("co_equal", 2, ["language=dp=2", "images=dp=2"], extra=CO_EQUAL)
    _balanced_like_unbalanced(reference_variable, on, off)


def test_colocated_fan_in_balanced_matches_single_process(reference_variable):
    """Fan-in over two gather groups (language tp 2 x dp 2, images dp 4), 2 samples per GPU in one
    micro-batch, the language term weighed in: the coupled plan moves samples between the language
    DP ranks too (their padded bridges cut the new shards), and the step is still the reference's."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.plan.build import build_plan
    from mimo_sft.plan.flags import PlanOptions

    layout = ["language=tp=2,dp=2", "images=dp=4"]
    extra = ["--scalable-dp", "--intra-microbatch-reorder", "--reorder-language-cost-weight", "1",
             "--micro-batch-size", "8"]
    on = layout_run("co_fanin_4_reorder", 4, layout, extra=extra)
    off = layout_run("co_fanin_4", 4, layout, extra=["--scalable-dp"])
    _balanced_like_unbalanced(reference_variable, on, off)
    # the run laid its micro-batch out as `plan` does (the logged vision figures are the plan's), and
    # that plan moved samples between the two language DP ranks (their token loads changed)
    plan = build_plan(load_config(["--hf-model", tiny_model(), "--dataset-path", demo_data(), *STEP,
                                   *[a for c in layout for a in ("--component", c)], *extra]), PlanOptions(steps=1))
    (want,) = plan["train_steps"]["vision_load_max_over_mean"]
    m = metrics(on)[0]
    for when in ("before", "after"):
        assert math.isclose(m[f"vision_load_max_over_mean_{when}"], want[f"max_over_mean_{when}"], rel_tol=1e-12)
    lang = plan["modules"]["language"]["per_micro_batch"]
    assert lang["max_after"][0] < lang["max_before"][0], lang


def test_failing_rank_ends_job_with_clear_error():
    data = fixed_size_data(16, broken_image=5)
    proc = torchrun(4, ["--hf-model", tiny_model(), "--dataset-path", data, "--seq-length", "128",
                        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "4",
                        "--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2",
                        "--scalable-dp", "--no-tensorboard", "--output-dir", new_dir("broken"),
                        "--max-bad-samples", "0"],  # refuse, as before --max-bad-samples (tests/test_bad_samples.py)
                    check=False, timeout=240)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert lines and "0005.png" in lines[0], proc.stderr[-3000:]


def test_export_after_training_loads_in_transformers(reference_variable):
    """The single-process reference run's checkpoint -> HF folder: transformers loads it, the weights
    are the trained ones (not the source's), and our conversion of it is exact (check-model)."""
    import json
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    out = new_dir("exported")
    subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", reference_variable + "/checkpoints",
                    "--out", out], check=True, capture_output=True)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.config.model_type == "qwen2_5_vl"
    before = load_file(tiny_model() + "/model.safetensors")
    after = load_file(out + "/model.safetensors")
    assert set(before) == set(after)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "training should have changed most weights"
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "check-model", "--hf-model", out, "--json"],
                          capture_output=True, text=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"], proc.stdout + proc.stderr


def test_colocated_fan_out_matches_single_process(reference_variable):
    """Encoder DP 1 (tower replicated on its 2 tp ranks) feeding language DP 2 on the same ranks, on
    mixed image sizes, multi-image and text-only samples."""
    run = layout_run("co_fanout", 2, ["language=dp=2", "images=tp=2,dp=1"], extra=["--scalable-dp"])
    assert_same_step(reference_variable, run)
    # the two replicas shared the micro-batch's images (train.tower_split), none encoded all of them
    patches = metrics(run)[0]["rank_patches"]
    assert len(patches) == 2 and min(patches) > 0 and max(patches) < sum(patches), patches


def test_freeze_flags_keep_weights_fixed():
    """--freeze-language --freeze-vision: only the patch merger (projector) changes in a step."""
    import torch
    from safetensors.torch import load_file

    run = layout_run("frozen", 3, ["language=dp=2", "images=dp=1,rank_offset=2"],
                     extra=["--scalable-dp", "--freeze-language", "--freeze-vision"])
    after = checkpoint_tensors(run + "/checkpoints/iter_0000001")
    hf = load_file(tiny_model() + "/model.safetensors")
    visual = {k.split("visual.", 1)[1]: v for k, v in hf.items() if "visual." in k}
    changed_merger = 0
    for key, value in after.items():
        if key.startswith("modality_submodules.images.encoders."):
            name = key.split(".", 4)[4]
            same = torch.equal(value, visual[name])
            if name.startswith("merger."):
                changed_merger += not same
            else:
                assert same, f"frozen vision weight {name} changed"
    assert changed_merger > 0, "the projector should train"
    embed = [v for k, v in hf.items() if k.endswith("embed_tokens.weight")][0]
    assert torch.equal(after["language_model.embedding.word_embeddings.weight"][: embed.shape[0]], embed)


def test_language_pipeline_parallel_matches_single_process(reference_variable):
    """language pp 2 (tied embeddings split across stages) fed by its own encoder rank."""
    assert_same_step(reference_variable, language_pp2())


def test_colocated_fan_in_with_a_text_only_encoder_slice(reference_corner):
    """Fan-in on the corner-case data: an encoder rank with no image while its gather group has some
    (it still joins the all-gather with zero rows), several images of different sizes in a sample,
    and a text-only micro-batch where no rank encodes. Without --scalable-dp: every rank reads the
    whole micro-batch and keeps its shard. A missed collective would hang: torchrun's timeout ends it."""
    run = layout_run("co_fanin_corner", 2, ["language=tp=2,dp=1", "images=dp=2"], bridge_corner_data(), CORNER)
    assert_same_step(reference_corner, run)


def test_colocated_fan_in_with_two_gather_groups(reference_variable):
    """language tp 2 x dp 2 and images dp 4 on 4 ranks: two bridge gather groups, each with its own
    padded length (the most image tokens of its own language shard)."""
    run = layout_run("co_fanin_4", 4, ["language=tp=2,dp=2", "images=dp=4"], extra=["--scalable-dp"])
    assert_same_step(reference_variable, run)


def test_colocated_fan_out_with_a_text_only_language_slice(reference_corner):
    """Fan-out on the corner-case data: a language rank with no image token while its encoder slice
    has images (its empty share still runs the backward all-gather)."""
    run = layout_run("co_fanout_corner", 2, ["language=dp=2", "images=tp=2,dp=1"], bridge_corner_data(),
                     [*CORNER, "--scalable-dp"])
    assert_same_step(reference_corner, run)


def test_no_supervised_tokens_is_an_error_not_a_silent_run(tmp_path):
    """A dataset whose rows have no assistant turn would train on nothing: refused at step 1."""
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"question {i}"}]}]}
            for i in range(16)]
    data = tmp_path / "noassistant.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = torchrun(1, ["--hf-model", tiny_model(), "--dataset-path", str(data),
                        "--component", "language=dp=1", "--component", "images=dp=1", "--seq-length", "128",
                        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2",
                        "--no-tensorboard", "--output-dir", new_dir("noassistant")], check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and "no supervised tokens" in errors[0], proc.stderr[-2000:]


def test_pretrained_checkpoint_loads_into_another_layout(reference_variable):
    """Weights saved by a 1-rank run start a 4-rank run: same step-1 loss and grad norm as a 1-rank
    run started from the same weights (dist-checkpoint weights are layout-free; every gradient and
    weight too: test_reordering_off_gives_same_step_one)."""
    single, multi = _from_the_reference(reference_variable)
    a, b, ref = metrics(single)[0], metrics(multi)[0], metrics(reference_variable)[0]
    assert a["step"] == b["step"] == 1
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5)
    assert a["loss"] < ref["loss"], "starting from trained weights should lower the step-1 loss on the same batch"


def test_export_hf_at_the_end_equals_the_export_command():
    """--export-hf exports in rank 0's process after training: the same files `mimo-sft export` writes
    from the final checkpoint, and transformers loads them (the colocated fan-in run: language tp 2)."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    run = colocated_fan_in()
    assert os.path.isfile(run + "/hf/model.safetensors")
    again = new_dir("export_hf_cmd")
    subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", run + "/checkpoints", "--out", again],
                   check=True, capture_output=True)
    a, b = load_file(run + "/hf/model.safetensors"), load_file(again + "/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert AutoModelForImageTextToText.from_pretrained(run + "/hf").config.model_type == "qwen2_5_vl"


# ---- in-batch packing: the packed step equals the padded single-process step -----------------------

def test_packed_non_colocated_with_reordering_matches_padded(reference_variable):
    run = packed_non_colocated()
    assert_packed_equals_padded(reference_variable, run)
    m = train_rows(run)[0]
    assert m["reorder_wait_s"] >= 0 and m["vision_load_max_over_mean_after"] <= m["vision_load_max_over_mean_before"]


def test_packed_colocated_fan_in_matches_padded(reference_variable):
    """language tp 2 / images dp 2 on the same ranks: packing after megatron's colocated bridge."""
    run = layout_run("packed_co_fanin", 2, ["language=tp=2,dp=1", "images=dp=2"], extra=["--scalable-dp", *PACKED])
    assert_packed_equals_padded(reference_variable, run)


def test_packed_language_pipeline_parallel_matches_padded(reference_variable):
    """language pp 2: both stages pack the same rows the same way (hidden states travel as [T, 1, H])."""
    run = layout_run("packed_pp2", 3, ["language=pp=2,dp=1", "images=dp=1,rank_offset=2"], extra=PACKED)
    assert_packed_equals_padded(reference_variable, run)


def test_packed_colocated_fan_out_with_a_text_only_language_slice(reference_corner):
    """Packing on the corner-case data: a language rank without image tokens, several images of
    different sizes in a sample, text-only micro-batches."""
    run = layout_run("packed_co_fanout_corner", 2, ["language=dp=2", "images=tp=2,dp=1"], bridge_corner_data(),
                     [*CORNER, "--scalable-dp", *PACKED])
    assert_packed_equals_padded(reference_corner, run)
