"""LoRA vs full fine-tuning on the same model, data and layout: trainable parameters, peak memory,
step time.

    .venv/bin/python scripts/bench_lora.py [--steps 8] [--text-hidden 768] [--text-layers 6] [--rank 16]

Writes a small Qwen2.5-VL (``make_tiny_qwen_vl.py`` with a wider, deeper language model, so that
the language model's optimizer state dominates) and the synthetic document dataset, then runs real
2-process CPU fine-tunes on the colocated layout language tp 2 + images dp 2 (the adapters are
tensor-parallel): full fine-tuning, and LoRA on the four language linears with the default freeze
flags (vision tower and projector still train) and with ``--freeze-vision --freeze-projector``
(adapters only). Prints one table row per setting.

Trainable parameters are counted on a 1-process build of the same model (whole model, not one
rank's shard). Peak memory is each process's peak RSS on the CPU (``peak_memory_bytes`` in
metrics.jsonl, the largest over the two ranks): it includes the Python/torch runtime, which is the
same in every setting, so the differences are what the settings change (gradient buffers, Adam
state). Step time is the median over steps after the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mimo_sft.testing.bench_runs import (  # noqa: E402
    bench_env, finetune_command, language_size_flags, read_metrics, run_session, write_inputs)

TARGETS = "linear_qkv,linear_proj,linear_fc1,linear_fc2"


def settings(rank: int) -> list[tuple[str, list[str]]]:
    lora = ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank), "--lora-target-modules", TARGETS]
    return [("full fine-tuning", []),
            (f"LoRA r={rank}, vision + projector trained", lora),
            (f"LoRA r={rank}, adapters only", [*lora, "--freeze-vision", "--freeze-projector"])]


def count_trainable(model_dir: str, flags: list[str]) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model under ``flags`` (a 1-process build)."""
    sys.path.insert(0, ROOT)
    from mimo_sft.config.loader import load_config
    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.lora import apply_lora, trainable_counts

    cfg = load_config(["--hf-model", model_dir, *flags])
    model, _ = build_single_process_model(model_dir, model_cfg=cfg.model, prefer="cpu")
    spec = LoraSpec.from_model_config(cfg.model)
    if spec is not None:
        apply_lora(model, spec, seed=0)
    return trainable_counts(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--text-hidden", type=int, default=768)
    ap.add_argument("--text-layers", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args()
    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_lora_")
    model, data = write_inputs(work, root=ROOT, env=env, data_flags=["--samples", str(args.samples)],
                               model_flags=[*language_size_flags(args.text_hidden, args.text_layers),
                                            "--heads", "8", "--kv-heads", "2"])
    rows = []
    for name, flags in settings(args.rank):
        out = os.path.join(work, str(len(rows)))
        cmd = finetune_command(2, [
            "--hf-model", model, "--dataset-path", data, "--output-dir", out, "--component", "language=tp=2,dp=1",
            "--component", "images=dp=2", "--scalable-dp", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(2 * args.micro_batch_size),
            "--train-iters", str(args.steps), "--dataloader-type", "cyclic", "--lr", "1e-4", "--no-tensorboard",
            "--save-interval", str(10**9), *flags])
        run_session(cmd, cwd=ROOT, env=env, log=os.path.join(work, f"log_{len(rows)}.txt"))
        m = read_metrics(out, skip_first=False)
        later = m[1:]
        trainable, total = count_trainable(model, flags)
        rows.append((name, trainable, total, max(r["peak_memory_bytes"] for r in m) / 2**20,
                     statistics.median(r["step_time_s"] for r in later), m[0]["loss"], m[-1]["loss"]))
    print(f"2 CPU processes, colocated language tp 2 + images dp 2, language {args.text_hidden} wide x "
          f"{args.text_layers} layers (ffn {4 * args.text_hidden}), --seq-length {args.seq_length}, "
          f"micro-batch {args.micro_batch_size}, global batch {2 * args.micro_batch_size}, {args.steps} steps, fp32")
    print("| setting | trainable params | of total | weights + grads + Adam MiB (computed, whole model) "
          "| peak RSS MiB (max rank) | step time s (median) | loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for name, tr, tot, mem, st, l0, l1 in rows:
        state = (4 * tot + 12 * tr) / 2**20  # fp32 weights; fp32 grad buffer + Adam moments for what trains
        print(f"| {name} | {tr:,} | {100 * tr / tot:.2f}% of {tot:,} | {state:.0f} | {mem:.0f} | {st:.3f} "
              f"| {l0:.3f} -> {l1:.3f} |")


if __name__ == "__main__":
    main()
