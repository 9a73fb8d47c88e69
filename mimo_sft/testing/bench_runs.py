"""What the benchmark scripts share: the environment of a benchmark run, a torchrun launcher, their
inputs (a small model and the synthetic dataset) and the fine-tune command and metrics they read.

Why a launcher: megatron's checkpoint writer processes can outlive torchrun and keep its output
pipe open, so ``subprocess.run(capture_output=True)`` may never return. Each run gets its own
session with output to a log file, and the session is ended when torchrun exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Sequence


def bench_env() -> dict:
    """One thread per process, offline hubs, quiet progress bars and warnings."""
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                HF_DATASETS_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def run_session(cmd: list[str], *, cwd: str, env: dict, log: str) -> None:
    """Run ``cmd`` in its own session with output to ``log``; SystemExit with the log's tail on failure."""
    with open(log, "w") as fh:
        child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        code = child.wait()
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{open(log).read()[-3000:]}")


def write_inputs(work: str, *, root: str, env: dict, model_flags: Sequence[str] = (),
                 data_flags: Sequence[str] = ()) -> tuple[str, str]:
    """``(model, data)`` folders under ``work``: a small Qwen2.5-VL and the synthetic document dataset.

    Written by ``scripts/make_tiny_qwen_vl.py`` and ``scripts/make_demo_data.py`` (the commands a
    user runs; ``model_flags`` / ``data_flags`` are theirs), each in a process of its own, so the
    benchmark's process never imports the model code it measures.
    """
    model, data = os.path.join(work, "model"), os.path.join(work, "data")
    for script, out, flags in (("make_tiny_qwen_vl.py", model, model_flags), ("make_demo_data.py", data, data_flags)):
        subprocess.run([sys.executable, os.path.join("scripts", script), out, *flags], cwd=root, check=True,
                       capture_output=True, env=env)
    return model, data


def language_size_flags(hidden: int, layers: int) -> list[str]:
    """``make_tiny_qwen_vl.py`` flags of a language model ``hidden`` wide and ``layers`` deep with the
    usual 4x MLP: the knob the step-time benchmarks turn to make the language model's work dominate."""
    return ["--text-hidden", str(hidden), "--text-layers", str(layers), "--intermediate", str(4 * hidden)]


def finetune_command(nproc: int, args: list[str]) -> list[str]:
    """``mimo-sft finetune args`` on ``nproc`` processes, by the torchrun next to this interpreter."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--nproc-per-node", str(nproc), "-m", "mimo_sft", "finetune", *args]


def colocated_dp2_args(*, model: str, data: str, out: str, seq_length: int, micro_batch_size: int,
                       global_batch_size: int, steps: int) -> list[str]:
    """The colocated 2-process layout of the step-time benchmarks: language dp 2 and images dp 2 on the
    same ranks (one per core), scalable DP, a cyclic loader, lr 1e-4, no TensorBoard."""
    return ["--hf-model", model, "--dataset-path", data, "--output-dir", out, "--component", "language=dp=2",
            "--component", "images=dp=2", "--scalable-dp", "--seq-length", str(seq_length),
            "--micro-batch-size", str(micro_batch_size), "--global-batch-size", str(global_batch_size),
            "--train-iters", str(steps), "--dataloader-type", "cyclic", "--lr", "1e-4", "--no-tensorboard"]


def read_metrics(out: str, *, skip_first: bool = True) -> list[dict]:
    """A run's ``metrics.jsonl`` rows; by default without the first step, whose time includes start-up."""
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return rows[1:] if skip_first else rows
