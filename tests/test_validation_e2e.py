"""Validation loss end to end under torchrun (gloo, CPU).

Reference: transformers' own Qwen2.5-VL model on the same validation samples at the same weights
(the tiny HF checkpoint: the step-0 value of ``--eval-at-start``; the exported best checkpoint:
a trained value), its loss over the assistant tokens, computed in the test process. Every layout gives that value (relative 1e-5): one process,
non-colocated with reordering and packing (DP 2), colocated language TP 2 with vision DP 2 (fan-in),
language PP 2; the training run's later values equal ``mimo-sft evaluate`` on its checkpoints; and
a run that evaluates trains bit-identically to one that does not.

The non-colocated run is ``tests/e2e_runs.py``'s packed one, which test_train_e2e.py also compares
with its padded single-process step.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import e2e_runs
from e2e_runs import GROUP_LAYOUTS, packed_non_colocated
from train_helpers import (ROOT, checkpoint_tensors, demo_data, metrics, new_dir, optimizer_tensors, tiny_model,
                           torchrun)

pytestmark = [pytest.mark.e2e, GROUP_LAYOUTS]

SEQ = 192
BASE = ["--seq-length", str(SEQ), "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--dataloader-type", "cyclic", "--seed", "7"]
ONE_PROCESS = ["--component", "language=dp=1", "--component", "images=dp=1"]


@pytest.fixture(scope="module")
def valid_data():
    """A separate validation file: 10 samples (two full micro-batches of 4 and a filled one)."""
    return e2e_runs.valid_data()


def hf_valid_loss(dataset_path: str, rows=None, *, model_dir=None) -> tuple[float, int]:
    """transformers' loss over the assistant tokens of ``rows`` of the dataset (one sample per
    forward, no padding): sum of its per-sample means times their token counts / all tokens."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.model.pixels import float_patches, pixel_norm_from

    cfg = DataConfig(dataset_path=dataset_path, seq_length=SEQ)
    source, pre = load_sft_dataset(cfg), build_preprocessor(cfg, tiny_model())
    hf = AutoModelForImageTextToText.from_pretrained(model_dir or tiny_model(), attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    total, count = 0.0, 0
    for i in (range(len(source)) if rows is None else rows):
        s = pre.encode(*source[i], i, need_pixels=True)
        assert s["n_tokens"] <= SEQ  # untruncated: transformers sees every target
        ids = s["input_ids"][None]
        labels = torch.full_like(ids, -100)  # transformers shifts: position t predicts labels[t + 1]
        labels[0, 1:] = torch.where(s["loss_mask"][:-1] > 0, ids[0, 1:], torch.full_like(ids[0, 1:], -100))
        n = int((labels != -100).sum())
        if n == 0:
            continue
        pixels = s.get("pixel_values")
        if pixels is not None:  # the data path's uint8 patches, as the processor's float ones (model.pixels)
            pixels = float_patches(pixels, pixel_norm_from(model_dir or tiny_model(), pre.image_backend))
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                     image_grid_thw=s.get("image_grid_thw"), mm_token_type_ids=s["mm_token_type_ids"][None],
                     labels=labels)
        total += float(out.loss) * n
        count += n
    return total / count, count


def valid_rows(run_dir: str) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir) if "valid_loss" in r}


train_rows = e2e_runs.train_rows


def finetune(name, nproc, args):
    return e2e_runs.finetune(name, nproc, [*BASE, *args])


def evaluate(nproc, args) -> dict:
    proc = torchrun(nproc, [*args, *BASE, "--json"], command="evaluate")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # printed once, by the metrics rank
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def evaluated_run(valid_data):
    """One process, evaluating at start, every step and after the last, keeping the best."""
    return finetune("valid_one", 1, [*ONE_PROCESS, "--valid-dataset-path", valid_data, "--train-iters", "2",
                                     "--eval-at-start", "--eval-interval", "1", "--save-best",
                                     "--keep-last-checkpoints", "1", "--save-interval", "2"])


def close(a, b, rel=1e-5):
    return math.isclose(a, b, rel_tol=rel)


def test_step_zero_value_equals_transformers_and_is_logged(evaluated_run, valid_data):
    run, proc = evaluated_run
    ref, tokens = hf_valid_loss(valid_data)
    rows = valid_rows(run)
    assert sorted(rows) == [0, 1, 2]
    assert close(rows[0]["valid_loss"], ref), (rows[0]["valid_loss"], ref)
    assert rows[0]["valid_tokens"] == tokens and rows[0]["valid_samples"] == 10
    for r in rows.values():
        assert close(r["valid_ppl"], math.exp(r["valid_loss"]), 1e-12)
    assert rows[2]["valid_loss"] < rows[0]["valid_loss"]  # lr 1e-3 on the tiny model: it learns
    assert "validation after step     0 | valid loss" in proc.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run, "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("valid/loss")] == [0, 1, 2]


def test_save_best_names_the_lowest_valid_loss_checkpoint(evaluated_run, valid_data):
    """``best`` names the lowest value's checkpoint; exported, transformers computes that value."""
    run, _ = evaluated_run
    rows = valid_rows(run)
    ckpts = os.path.join(run, "checkpoints")
    best_step = min((1, 2), key=lambda s: rows[s]["valid_loss"])
    best = open(os.path.join(ckpts, "best")).read().strip()
    assert best == f"iter_{best_step:07d}"
    meta = json.load(open(os.path.join(ckpts, best, "meta.json")))
    assert meta["valid_loss"] == rows[best_step]["valid_loss"]
    assert os.path.isdir(os.path.join(ckpts, "iter_0000002"))  # latest, kept by --keep-last-checkpoints 1
    hf_dir = new_dir("valid_best_hf")
    subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", os.path.join(ckpts, best),
                    "--out", hf_dir], check=True, capture_output=True, cwd=str(ROOT), timeout=300,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    ref, _tokens = hf_valid_loss(valid_data, model_dir=hf_dir)
    assert close(rows[best_step]["valid_loss"], ref), (rows[best_step]["valid_loss"], ref)


def test_evaluation_leaves_training_bit_identical(evaluated_run):
    """Same run without any validation flag: every step's loss and grad norm, the final weights and
    the optimizer state are bit-identical (no RNG draw, no gradient, no optimizer side effect)."""
    run, _ = evaluated_run
    plain, _ = finetune("valid_plain", 1, [*ONE_PROCESS, "--train-iters", "2", "--save-interval", "2"])
    a, b = train_rows(run), train_rows(plain)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == [(r["step"], r["loss"], r["grad_norm"]) for r in b]
    for read in (checkpoint_tensors, optimizer_tensors):
        x, y = read(run + "/checkpoints/iter_0000002"), read(plain + "/checkpoints/iter_0000002")
        assert set(x) == set(y) and x
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_non_colocated_reordered_packed_run_gives_the_same_values(evaluated_run, valid_data):
    """Language DP 2 and vision DP 2 on separate ranks, reordering and in-batch packing on: the
    step-0 and step-1 values of the one-process run."""
    ref = valid_rows(evaluated_run[0])
    run = packed_non_colocated()
    assert valid_data == e2e_runs.valid_data()  # the set it evaluates
    rows = valid_rows(run)
    assert sorted(rows) == [0, 1]
    for step in (0, 1):
        assert close(rows[step]["valid_loss"], ref[step]["valid_loss"]), (step, rows[step], ref[step])
        assert rows[step]["valid_tokens"] == ref[step]["valid_tokens"]


def test_evaluate_command_on_a_checkpoint_with_language_pipeline_parallel(evaluated_run, valid_data):
    """``mimo-sft evaluate CHECKPOINT`` on the run's last checkpoint, language PP 2 (3 ranks): the
    run's own value after step 2."""
    run, _ = evaluated_run
    got = evaluate(3, [run + "/checkpoints", "--dataset-path", valid_data,  # base model: from its meta.json
                       "--component", "language=pp=2,dp=1", "--component", "images=dp=1,rank_offset=2"])
    assert got["hf_model"] == tiny_model()
    ref = valid_rows(run)[2]
    assert close(got["loss"], ref["valid_loss"]), (got, ref)
    assert got["tokens"] == ref["valid_tokens"] and got["samples"] == 10
    assert close(got["perplexity"], math.exp(got["loss"]), 1e-12)


def test_evaluate_command_hf_model_on_a_held_out_split_colocated_tensor_parallel():
    """``--hf-model`` alone, ``--valid-split 8`` of the training file, colocated language TP 2 fed by
    vision DP 2 (fan-in): transformers' loss on exactly the held-out rows."""
    from mimo_sft.data.validation import holdout_rows

    got = evaluate(2, ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--valid-split", "8", "--component", "language=tp=2,dp=1",
                       "--component", "images=dp=2", "--scalable-dp"])
    _train, rows = holdout_rows(96, 8, seed=7, min_train=8)
    ref, tokens = hf_valid_loss(demo_data(), rows)
    assert close(got["loss"], ref), (got, ref)
    assert got["tokens"] == tokens and got["samples"] == 8


def test_eval_interval_without_a_validation_set_is_one_line_before_any_process_starts():
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "finetune", "--hf-model", tiny_model(),
                           "--dataset-path", demo_data(), *ONE_PROCESS, "--eval-interval", "2",
                           "--output-dir", new_dir("valid_bad")], capture_output=True, text=True, cwd=str(ROOT),
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore"), timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: [28] --eval-interval without a validation set: add --valid-dataset-path PATH or "
                      "--valid-split N|FRACTION"], proc.stderr
