"""Ops and host reads per training step, by phase, for every family at 2 and 8 layers -- on a CPU.

What a GPU would launch and wait for, counted on the device audit's stand-in device
(``mimo_sft.testing.device_audit``): every aten op that computes on a would-be device tensor (views left out:
roughly the kernels a GPU launches, before any fusion) and every read of a device value back to the host (a
device sync on a GPU), per training step, split into forward (data, tower, language forward and loss), backward
and optimizer (gradient finalize and the optimizer step). One rank, the colocated layout of one GPU, packed, the
tiny models with ``L`` language layers and ``L`` vision blocks, on clips and pages; the second step is shown (the
first also allocates Adam's state).

    .venv/bin/python scripts/bench_step_ops.py [--layers 2 8] [--families ...] [--json OUT]

A per-tensor loop in a phase shows as its op count growing with the layers' parameter tensors; the optimizer
phase should not grow at all (a few kernels per bucket).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")


def spec_for(root: str, families, layers) -> dict:
    from mimo_sft.testing.clips import write_video_dataset
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    data = str(write_video_dataset(os.path.join(root, "video"), samples=8, seed=3).parent)
    spec = {}
    for family in families:
        for n in layers:
            model = write_tiny_checkpoint(os.path.join(root, f"{family}_{n}"), seed=0, family=family, text_layers=n,
                                          vision_depth=n)
            spec[f"{family} {n}"] = {"steps": 2, "flags": [
                "--hf-model", str(model), "--dataset-path", data, "--output-dir", os.path.join(root, f"run_{family}_{n}"),
                "--component", "language=dp=1", "--component", "images=dp=1", "--seq-length", "256",
                "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3", "--no-save",
                "--no-tensorboard", "--dataloader-type", "cyclic", "--num-workers", "0", "--lr", "1e-3",
                "--log-interval", "1"]}
    return spec


def table(reports: dict) -> list[str]:
    from mimo_sft.testing.audit_run import by_group

    lines = [f"| run | param tensors | forward ops | backward ops | optimizer ops | host reads (step + metrics) |",
             "|---|---|---|---|---|---|"]
    for name, run in reports.items():
        step, log = run["steps"][-1], run["logs"][-1]
        ops = by_group(step["ops_by_phase"])
        reads = by_group(step["reads_by_phase"])
        lines.append(f"| {name} layers | {run['param_tensors']} | {ops['forward']} | {ops['backward']} | "
                     f"{ops['optimizer']} | {sum(step['reads'].values())} + {sum(log['reads'].values())} "
                     f"(fwd {reads['forward']}, bwd {reads['backward']}, opt {reads['optimizer']}) |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--json", help="write the audit's full report (every read with its call site) here")
    args = parser.parse_args()
    from mimo_sft.testing.audit_run import run_specs

    with tempfile.TemporaryDirectory() as root:
        reports = run_specs(spec_for(root, args.families, args.layers), os.path.join(root, "report.json"))
    print("\n".join(table(reports)))
    for name, run in reports.items():
        sites = {**run["steps"][-1]["reads"], **{f"(metrics) {k}": v for k, v in run["logs"][-1]["reads"].items()}}
        print(f"{name} layers: " + ("; ".join(f"{n}x {site}" for site, n in sorted(sites.items())) or "no read"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(reports, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
