"""Step time with overlapped gradient reduction / parameter gather on and off (CPU, 2 processes).

    .venv/bin/python scripts/bench_step.py [--steps 20] [--text-hidden 256] [--text-layers 4]

Runs real 2-process colocated CPU fine-tunes (language dp 2 and images dp 2 on the same ranks, one
per core, gloo) of a small Qwen2.5-VL on the synthetic document dataset, with the distributed
optimizer, in three settings: no overlap (one bucket reduced after backward, weights gathered right
after the optimizer step), overlapped reduction only, and overlapped reduction and parameter gather
(the default). Prints one table row per setting from each run's metrics.jsonl (steps after the
first, which includes start-up), and each run's last loss (the settings must agree).

On CPU with gloo the overlap can only show what it costs (more, smaller collectives, a background
wait) and, at best, what it hides of a reduction that the same two cores also compute: it is no
forecast of a GPU, where NCCL runs on its own streams beside the compute kernels.
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
    bench_env, colocated_dp2_args, finetune_command, language_size_flags, read_metrics, run_session, write_inputs)

SETTINGS = [
    ("no overlap", ["--no-overlap-grad-reduce"]),
    ("overlapped reduction", ["--overlap-grad-reduce", "--no-overlap-param-gather"]),
    ("overlapped reduction + param gather", ["--overlap-grad-reduce", "--overlap-param-gather"]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--text-hidden", type=int, default=256)
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size of the overlapped rows")
    ap.add_argument("--samples", type=int, default=400)
    args = ap.parse_args()
    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_step_")
    model, data = write_inputs(work, root=ROOT, env=env, data_flags=["--samples", str(args.samples)],
                               model_flags=language_size_flags(args.text_hidden, args.text_layers))
    rows = []
    for name, flags in SETTINGS:
        out = os.path.join(work, name.replace(" ", "_").replace("+", ""))
        bucket = ["--ddp-bucket-size", str(args.bucket_size)] if "--overlap-grad-reduce" in flags else []
        run = colocated_dp2_args(model=model, data=data, out=out, seq_length=args.seq_length,
                                 micro_batch_size=args.micro_batch_size, steps=args.steps,
                                 global_batch_size=args.micro_batches * args.micro_batch_size)
        cmd = finetune_command(2, [*run, "--no-save", "--use-distributed-optimizer", *flags, *bucket])
        run_session(cmd, cwd=ROOT, env=env, log=out + ".log")
        m = read_metrics(out)
        rows.append((name, statistics.median(r["step_time_s"] for r in m), min(r["step_time_s"] for r in m),
                     statistics.mean(r["tokens_per_s"] for r in m), m[-1]["loss"]))
    params = 12 * args.text_hidden ** 2 * args.text_layers
    print(f"2 CPU processes (gloo), colocated language dp 2 + images dp 2, distributed optimizer, language "
          f"{args.text_hidden} wide x {args.text_layers} layers (~{params / 1e6:.1f}M decoder parameters + embeddings), "
          f"--seq-length {args.seq_length}, {args.micro_batches} micro-batches of {args.micro_batch_size}, "
          f"--ddp-bucket-size {args.bucket_size:,} in the overlapped rows, {args.steps} steps, over steps 2..{args.steps}")
    print("| setting | step time (s, median) | step time (s, min) | tokens/s | last loss |")
    print("|---|---|---|---|---|")
    base = rows[0][1]
    for name, med, low, tps, loss in rows:
        print(f"| {name} | {med:.3f} ({med / base:.2f}x) | {low:.3f} | {tps:.0f} | {loss:.6f} |")


if __name__ == "__main__":
    main()
