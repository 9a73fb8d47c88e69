"""What a run keeps and says (issue 26): the final weights without any save flag, where checkpoints go,
answers cut at --seq-length and empty answers counted per step, an export failing after training
naming the checkpoint it kept; --no-save keeps nothing and says so. Real torchrun runs, tiny model."""

from __future__ import annotations

import json
import os

import pytest

from train_helpers import metrics, new_dir, tiny_model, torchrun

LONG = " ".join(f"word{i}" for i in range(300))  # far past --seq-length 128


def _rows():
    rows = []
    for i in range(8):
        answer = LONG if i == 2 else "" if i == 5 else f"It is {2 * i + 1}."
        rows.append({"messages": [{"role": "user", "content": [{"type": "text", "text": f"What is {i} plus {i + 1}?"}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
    return rows


def _args(tmp_path, out, *extra):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return ["--hf-model", tiny_model(), "--dataset-path", str(data), "--component", "language=dp=1",
            "--component", "images=dp=1", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--train-iters", "2", "--no-tensorboard", "--output-dir", out, *extra]


def test_final_weights_kept_counts_reported_and_failed_export_names_the_checkpoint(tmp_path):
    out = new_dir("keeps_final")
    export = tmp_path / "hf"
    (export / "model.safetensors").mkdir(parents=True)  # a folder where export writes its weights: it fails after training
    proc = torchrun(1, _args(tmp_path, out, "--export-hf", str(export)), check=False)
    kept = os.path.join(out, "checkpoints", "iter_0000002")
    assert f"checkpoints: {out}/checkpoints, at the end (step 2)" in proc.stdout, proc.stdout[-2000:]
    assert "Gated DeltaNet" not in proc.stdout  # (Qwen2.5-VL has none; a Qwen3.5 banner says which kernels run)
    assert os.path.isfile(os.path.join(kept, "meta.json")), "no save flag given: the final step must still be saved"
    # the export failed after training: one line naming what was kept, non-zero exit, no traceback
    ours = proc.stderr.split("torch/distributed/elastic")[0]  # what torchrun's agent prints after is its own
    assert proc.returncode != 0 and "Traceback" not in ours, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"final checkpoint is kept in {kept}" in errors[0], proc.stderr[-2000:]
    assert "--export-hf" in errors[0] and "mimo-sft export --checkpoint" in errors[0]
    m = metrics(out)
    assert [r["truncated_samples"] for r in m] == [1, 0] and [r["empty_answers"] for r in m] == [0, 1]
    assert "step 1 has 1 answer(s) cut at --seq-length 128 (first: sample 2)" in proc.stdout
    assert "step 2 has 1 sample(s) with an empty assistant answer" in proc.stdout and "(first: sample 5)" in proc.stdout
    assert "data over the run: 1 answer(s) cut at --seq-length 128 (first: sample 2); 1 sample(s)" in proc.stdout


def test_no_save_keeps_nothing_and_says_so(tmp_path):
    out = new_dir("no_save")
    proc = torchrun(1, _args(tmp_path, out, "--no-save", "--train-iters", "1"))
    assert "--no-save: no checkpoint will be written" in proc.stdout
    assert not os.path.exists(os.path.join(out, "checkpoints")) and os.path.isfile(os.path.join(out, "metrics.jsonl"))


def test_the_eta_follows_the_steps_pace_not_a_save_between_them(tmp_path, monkeypatch):
    """Issue 44 item 5: the ETA jumped after every checkpoint save (3 s to 27 s at 0.06 s/step): it was the wall
    time per step so far. It is now the median of the steps' own times (the first's warm-up left out)."""
    from types import SimpleNamespace

    from mimo_sft.train import metrics as metrics_module
    from mimo_sft.train.metrics import MetricsLogger

    clock = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=100, tensorboard=False)

    def step(n, seconds):
        clock[0] += seconds
        logger.log(SimpleNamespace(step=n, step_time_s=seconds, to_json=lambda: {"step": n}, loss=1.0, lr=1e-3,
                                   grad_norm=1.0, tokens_per_s=1.0, mfu=None, moe={},
                                   vision_load_max_over_mean_before=None, vision_load_max_over_mean_after=None,
                                   ranks={}, gpus={}))

    step(1, 2.0)  # warm-up
    for n in range(2, 11):
        step(n, 0.06)
    before = logger.eta_s(10)
    clock[0] += 3.0  # a checkpoint save
    step(11, 0.06)
    assert before == pytest.approx(0.06 * 90) and logger.eta_s(11) == pytest.approx(0.06 * 89)
