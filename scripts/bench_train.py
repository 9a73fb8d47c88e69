"""Training speed of the demo layout with reordering off, on (synchronous) and on (overlapped).

    .venv/bin/python scripts/bench_train.py [--steps 30] [--micro-batch-size 8]

Runs real 4-process CPU fine-tunes (language dp 2 on ranks 0-1, images dp 2 on ranks 2-3) on a
tiny Qwen2.5-VL and the synthetic document dataset, then prints one table row per setting from
each run's metrics.jsonl (steps after the first, which includes start-up).
On a 2-core machine the 4 processes share 2 cores, so step times measure the pipeline's CPU cost,
not GPU stragglers; the vision-load columns are what reordering changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = [
    ("reorder off", ["--no-intra-microbatch-reorder"]),
    ("reorder on, synchronous", ["--intra-microbatch-reorder", "--no-overlap-intra-microbatch-reorder"]),
    ("reorder on, overlapped", ["--intra-microbatch-reorder", "--overlap-intra-microbatch-reorder"]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--vision-hidden", type=int, default=32, help="vision tower width (a heavier tower makes the straggler visible)")
    ap.add_argument("--vision-depth", type=int, default=2)
    args = ap.parse_args()
    py = sys.executable
    work = tempfile.mkdtemp(prefix="bench_train_")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore")
    model, data = os.path.join(work, "model"), os.path.join(work, "data")
    subprocess.run([py, "scripts/make_tiny_qwen_vl.py", model, "--vision-hidden", str(args.vision_hidden),
                    "--vision-depth", str(args.vision_depth)], cwd=ROOT, check=True, capture_output=True, env=env)
    subprocess.run([py, "scripts/make_demo_data.py", data, "--samples", str(args.samples)], cwd=ROOT, check=True,
                   capture_output=True, env=env)
    torchrun = os.path.join(os.path.dirname(py), "torchrun")
    rows = []
    for name, flags in SETTINGS:
        out = os.path.join(work, name.replace(" ", "_").replace(",", ""))
        cmd = [torchrun, "--nproc-per-node", "4", "-m", "mimo_sft", "finetune", "--config", "configs/demo.yaml",
               "--hf-model", model, "--dataset-path", data, "--output-dir", out, "--train-iters", str(args.steps),
               "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(2 * args.micro_batch_size),
               "--no-tensorboard", "--save-interval", str(10**9), *flags]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
        m = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
        before = [r["vision_load_max_over_mean_before"] for r in m]
        after = [r["vision_load_max_over_mean_after"] for r in m if r["vision_load_max_over_mean_after"] is not None]
        rows.append((name, statistics.median(r["step_time_s"] for r in m), statistics.mean(r["tokens_per_s"] for r in m),
                     statistics.mean(before), statistics.mean(after) if after else None,
                     statistics.mean(r["reorder_exchange_s"] for r in m) * 1000,
                     max(r["peak_memory_bytes"] for r in m) / 2**20))
    print(f"4 CPU processes (language dp 2 + images dp 2), vision tower {args.vision_hidden} wide x "
          f"{args.vision_depth} deep, micro-batch {args.micro_batch_size}, "
          f"{args.steps} steps, medians/means over steps 2..{args.steps}")
    print("| setting | step time (s, median) | tokens/s | vision max/mean before | vision max/mean after | exchange ms/step | peak RSS MiB (metrics rank) |")
    print("|---|---|---|---|---|---|---|")
    for name, st, tps, b, a, ex, mem in rows:
        print(f"| {name} | {st:.3f} | {tps:.0f} | {b:.3f} | {'-' if a is None else f'{a:.3f}'} | {ex:.1f} | {mem:.0f} |")


if __name__ == "__main__":
    main()
