"""Summarise a run folder's metrics.jsonl: loss curve ends, vision-load spread, speed.

    .venv/bin/python scripts/summarize_run.py RUN_DIR
Exits non-zero if the run has no metrics (so `make demo` fails loudly when training did not run).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    run = sys.argv[1]
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"error: {path} not found: the fine-tune did not log any step", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in open(path)]
    evaluations = [r for r in rows if "valid_loss" in r]
    rows = [r for r in rows if "loss" in r]  # training steps (evaluations have their own rows)
    if not rows:
        print(f"error: {path} has no training step", file=sys.stderr)
        return 1
    k = max(1, len(rows) // 5)
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    before = [r["vision_load_max_over_mean_before"] for r in rows if r["vision_load_max_over_mean_before"] is not None]
    after = [r["vision_load_max_over_mean_after"] for r in rows if r["vision_load_max_over_mean_after"] is not None]
    print(f"steps: {len(rows)}   loss: {first:.3f} (mean of first {k}) -> {last:.3f} (mean of last {k})"
          f"   {'falling' if last < first else 'NOT falling'}")
    if before:
        line = f"heaviest vision rank / mean vision load: {sum(before) / len(before):.3f} without reordering"
        if after:
            line += f", {sum(after) / len(after):.3f} with reordering"
        print(line)
    steady = rows[1:] or rows
    print(f"mean step time {sum(r['step_time_s'] for r in steady) / len(steady):.3f} s, "
          f"{sum(r['tokens_per_s'] for r in steady) / len(steady):.0f} tokens/s, "
          f"reorder exchange {sum(r['reorder_exchange_s'] for r in steady) / len(steady) * 1000:.1f} ms/step "
          f"(on the background thread when overlapped), training loop waited "
          f"{sum(r.get('reorder_wait_s', 0.0) for r in steady) / len(steady) * 1000:.1f} ms/step for it, "
          f"padding {100 * sum(r.get('padding_fraction', 0.0) for r in steady) / len(steady):.1f} % of language positions")
    tflops = [r["model_tflops_per_gpu"] for r in steady if r.get("model_tflops_per_gpu") is not None]
    if tflops:
        mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
        print(f"model {sum(tflops) / len(tflops):.2f} TFLOP/s per GPU"
              + (f", MFU {100 * sum(mfu) / len(mfu):.1f} %" if mfu else " (MFU: unknown peak; pass --peak-tflops)"))
    peaks = {k[len("peak_memory_bytes_"):]: max(r[k] for r in rows) for k in rows[-1] if k.startswith("peak_memory_bytes_")}
    if peaks:
        print("peak memory per module (largest rank, GiB): "
              + ", ".join(f"{name} {value / 2**30:.2f}" for name, value in peaks.items()))
    if evaluations:
        print(f"valid loss: {evaluations[0]['valid_loss']:.3f} after step {evaluations[0]['step']} -> "
              f"{evaluations[-1]['valid_loss']:.3f} after step {evaluations[-1]['step']} "
              f"({len(evaluations)} evaluations)")
    print(f"metrics: {path}; checkpoints: {os.path.join(run, 'checkpoints')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
