"""Training speed: reordering off / on (the demo layout), and padded vs packed / SDPA vs local attention.

    .venv/bin/python scripts/bench_train.py [--steps 30] [--micro-batch-size 8]
    .venv/bin/python scripts/bench_train.py --suite packing [--steps 20] [--seq-length 384]
    .venv/bin/python scripts/bench_train.py --colocated [--nproc 4] [--steps 20]

Runs real 4-process CPU fine-tunes (language dp 2 on ranks 0-1, images dp 2 on ranks 2-3) on a
tiny Qwen2.5-VL and the synthetic document dataset, then prints one table row per setting from
each run's metrics.jsonl (steps after the first, which includes start-up).
On a 2-core machine the 4 processes share 2 cores, so step times measure the pipeline's CPU cost,
not GPU stragglers; the vision-load columns are what reordering changes.

``--suite packing``: 2 colocated processes (language dp 2 and images dp 2 on the same ranks, one per
core) on the same dataset with long-tailed answers (``make_demo_data.py --long-answers``) and a
wider language model, padded to ``--seq-length`` with megatron's local attention, padded with the
SDPA core, and packed (``--in-batch-packing``, SDPA). Real tokens/s counts only non-padding tokens.

``--colocated``: every process runs both modules (``--nproc 4``: language tp 2 x dp 2 and images dp 4,
fan-in; ``--nproc 2``: language dp 2 and images dp 2), a vision tower heavy enough to gate the step,
the synthetic pages of mixed sizes; reordering off against on (the per-GPU plan,
``data.reorder.colocated_plan``). The heaviest GPU over the mean comes from ``mimo-sft plan --json``
on the same flags (its ``gpus`` rows: the same micro-batches, as the run lays them out).
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
    ("reorder off", ["--no-intra-microbatch-reorder"]),
    ("reorder on, synchronous", ["--intra-microbatch-reorder", "--no-overlap-intra-microbatch-reorder"]),
    ("reorder on, overlapped", ["--intra-microbatch-reorder", "--overlap-intra-microbatch-reorder"]),
]


PACKING_SETTINGS = [
    ("padded, local attention", ["--attention-backend", "local", "--no-in-batch-packing"]),
    ("padded, SDPA", ["--attention-backend", "sdpa", "--no-in-batch-packing"]),
    ("packed, SDPA", ["--attention-backend", "sdpa", "--in-batch-packing"]),
]


def packing_suite(args) -> None:
    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_packing_")
    model, data = write_inputs(work, root=ROOT, env=env, data_flags=["--samples", str(args.samples), "--long-answers"],
                               model_flags=language_size_flags(args.text_hidden, args.text_layers))
    rows = []
    for name, flags in PACKING_SETTINGS:
        out = os.path.join(work, name.replace(" ", "_").replace(",", ""))
        run = colocated_dp2_args(model=model, data=data, out=out, seq_length=args.seq_length,
                                 micro_batch_size=args.micro_batch_size, global_batch_size=2 * args.micro_batch_size,
                                 steps=args.steps)
        run_session(finetune_command(2, [*run, *flags]), cwd=ROOT, env=env, log=out + ".log")
        m = read_metrics(out)
        rows.append((name, statistics.median(r["step_time_s"] for r in m), statistics.mean(r["tokens_per_s"] for r in m),
                     statistics.mean(r["padding_fraction"] for r in m), max(r["peak_memory_bytes"] for r in m) / 2**20,
                     m[-1]["loss"]))
    print(f"2 CPU processes, colocated (language dp 2 + images dp 2), language {args.text_hidden} wide x "
          f"{args.text_layers} layers, --seq-length {args.seq_length}, micro-batch {args.micro_batch_size}, "
          f"long-tailed answers, {args.steps} steps, medians/means over steps 2..{args.steps}")
    print("| setting | step time (s, median) | real tokens/s | padding fraction | peak RSS MiB | last loss |")
    print("|---|---|---|---|---|---|")
    base = rows[0][2]
    for name, st, tps, pad, mem, loss in rows:
        print(f"| {name} | {st:.3f} | {tps:.0f} ({tps / base:.2f}x) | {pad:.3f} | {mem:.0f} | {loss:.4f} |")


COLOCATED_LAYOUTS = {4: ["language=tp=2,dp=2", "images=dp=4"], 2: ["language=dp=2", "images=dp=2"]}


def colocated_suite(args) -> None:
    import json
    import subprocess

    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_colocated_")
    model, data = write_inputs(work, root=ROOT, env=env, data_flags=["--samples", str(args.samples)],
                               model_flags=["--vision-hidden", str(args.vision_hidden),
                                            "--vision-depth", str(args.vision_depth)])
    layout = [a for c in COLOCATED_LAYOUTS[args.nproc] for a in ("--component", c)]
    common = ["--hf-model", model, "--dataset-path", data, *layout, "--scalable-dp", "--micro-batch-size",
              str(args.micro_batch_size), "--global-batch-size", str(2 * args.micro_batch_size), "--dataloader-type",
              "cyclic", "--no-in-batch-packing", "--seq-length", str(args.seq_length)]
    plan = subprocess.run([sys.executable, "-m", "mimo_sft", "plan", *common, "--steps", str(2 * args.steps), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    gpus = json.loads(plan.stdout.strip().splitlines()[-1])["modules"]["gpus"]
    rows = []
    for name, flags in (("reorder off", ["--no-intra-microbatch-reorder"]),
                        ("reorder on (per-GPU plan)", ["--intra-microbatch-reorder"])):
        out = os.path.join(work, name.split(" (")[0].replace(" ", "_"))
        cmd = finetune_command(args.nproc, [*common, *flags, "--output-dir", out, "--train-iters", str(args.steps),
                                            "--lr", "1e-4", "--no-tensorboard", "--save-interval", str(10**9)])
        run_session(cmd, cwd=ROOT, env=env, log=out + ".log")
        m = read_metrics(out)
        after = [r["vision_load_max_over_mean_after"] for r in m if r["vision_load_max_over_mean_after"] is not None]
        rows.append((name, statistics.median(r["step_time_s"] for r in m),
                     statistics.mean(r["vision_load_max_over_mean_before"] for r in m),
                     statistics.mean(after) if after else None))
    print(f"{args.nproc} CPU processes, colocated ({' + '.join(COLOCATED_LAYOUTS[args.nproc])}), vision tower "
          f"{args.vision_hidden} wide x {args.vision_depth} deep, micro-batch {args.micro_batch_size}, "
          f"--seq-length {args.seq_length}, {args.steps} steps, medians/means over steps 2..{args.steps}")
    print("| setting | step time (s, median) | heaviest GPU / mean (plan) | vision max/mean (metrics) |")
    print("|---|---|---|---|")
    for (name, st, b, a), when in zip(rows, ("before", "after")):
        vision = f"{b:.3f}" if a is None else f"{a:.3f}"
        print(f"| {name} | {st:.3f} | {gpus[f'max_over_mean_{when}']:.3f} | {vision} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=("reorder", "packing"), default="reorder")
    ap.add_argument("--colocated", action="store_true", help="colocated layouts: reordering off vs on per GPU")
    ap.add_argument("--nproc", type=int, choices=(2, 4), default=4, help="--colocated: processes (GPUs)")
    ap.add_argument("--seq-length", type=int, default=384, help="packing suite: tokens per padded sample")
    ap.add_argument("--text-hidden", type=int, default=256, help="packing suite: language model width")
    ap.add_argument("--text-layers", type=int, default=4, help="packing suite: language model depth")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--vision-hidden", type=int, default=32, help="vision tower width (a heavier tower makes the straggler visible)")
    ap.add_argument("--vision-depth", type=int, default=2)
    args = ap.parse_args()
    if args.suite == "packing":
        return packing_suite(args)
    if args.colocated:
        return colocated_suite(args)
    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_train_")
    model, data = write_inputs(work, root=ROOT, env=env, data_flags=["--samples", str(args.samples)],
                               model_flags=["--vision-hidden", str(args.vision_hidden),
                                            "--vision-depth", str(args.vision_depth)])
    rows = []
    for name, flags in SETTINGS:
        out = os.path.join(work, name.replace(" ", "_").replace(",", ""))
        cmd = finetune_command(4, [
            "--config", "configs/demo.yaml", "--hf-model", model, "--dataset-path", data, "--output-dir", out,
            "--train-iters", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(2 * args.micro_batch_size), "--no-tensorboard", "--save-interval", str(10**9),
            "--no-in-batch-packing", *flags])
        run_session(cmd, cwd=ROOT, env=env, log=out + ".log")
        m = read_metrics(out)
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
