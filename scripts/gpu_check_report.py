"""What the GPU check reads back from its runs (``scripts/gpu_check.py``): per-run figures from metrics.jsonl,
a profile's kernel table, the mimo-sft / transformers comparison. Standard library only: the orchestrator that
imports it runs on the GPU machine's bare interpreter, before anything is installed.
"""

from __future__ import annotations

import collections
import json
import os
import re
import statistics

GIB = 2**30


def run_figures(run_dir: str, warmup: int) -> dict | None:
    """A finetune run's figures from its metrics.jsonl (None if it logged no step). Steps after the first
    ``warmup`` give the medians and tokens/s; real tokens of a step = its tokens/s x its step time."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"step_time_s"' in line]
    if not rows:
        return None
    timed = rows[warmup:] if len(rows) > warmup else rows
    seconds = sum(r["step_time_s"] for r in timed)
    losses = [r["loss"] for r in rows]
    return {
        "steps": len(rows), "warmup": len(rows) - len(timed), "losses": losses, "loss_fell": losses[-1] < losses[0],
        "step_times": [r["step_time_s"] for r in rows],
        "real_tokens": [round(r["tokens_per_s"] * r["step_time_s"]) for r in rows],
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / seconds,
        "tflops_median": statistics.median(r.get("model_tflops_per_gpu") or 0.0 for r in timed),
        "mfu_median": statistics.median(r["mfu"] for r in timed) if all(r.get("mfu") is not None for r in timed) else None,
        "padding_fraction_median": statistics.median(r.get("padding_fraction") or 0.0 for r in timed),
        # per step: the device's peak allocated on a GPU, the process's peak resident set on the CPU
        "peak_memory_bytes": max(r.get("peak_memory_bytes") or 0 for r in rows),
    }


def memory_row(label: str, figures: dict | None, result: dict | None) -> dict:
    """Peak allocated / reserved against the forecast, in GiB, for one run (what the memory stage prints)."""
    figures, result = figures or {}, result or {}
    fc = (result.get("forecast") or {}).get("bytes")
    on_gpu = result.get("device") not in (None, "cpu")
    row = {"run": label, "device": result.get("device"),
           "forecast_gib": fc / GIB if fc else None,
           "peak_allocated_gib": figures.get("peak_memory_bytes", 0) / GIB if on_gpu else None,
           "peak_reserved_gib": (result.get("peak_reserved_bytes") or 0) / GIB if on_gpu else None,
           "host_peak_rss_gib": None if on_gpu else figures.get("peak_memory_bytes", 0) / GIB,
           "device_gib": (result.get("device_memory_bytes") or 0) / GIB or None}
    if on_gpu and fc:
        row["allocated_over_forecast"] = figures.get("peak_memory_bytes", 0) / fc
        row["reserved_over_forecast"] = (result.get("peak_reserved_bytes") or 0) / fc
    return row


def compare(mimo: dict, hf: dict) -> dict:
    """mimo-sft against transformers on the same rows: time ratio over the common steps after warm-up."""
    n = min(mimo["steps"], hf["steps"])
    k = max(mimo["warmup"], hf.get("warmup", 0))
    k = k if n > k else 0
    return {"steps_compared": n - k, "hf_time_over_mimo_time": sum(hf["step_times"][k:n]) / sum(mimo["step_times"][k:n]),
            "same_real_tokens": mimo["real_tokens"][:n] == hf["real_tokens"][:n],
            "loss_first": [mimo["losses"][0], hf["losses"][0]], "loss_last": [mimo["losses"][n - 1], hf["losses"][n - 1]]}


def _self_times(events: list) -> dict:
    """name -> [self microseconds, count] of host ops: an op's duration less its direct children's, per thread."""
    out = collections.defaultdict(lambda: [0.0, 0])
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list = []  # [end, event, children's time]
        for e in evs + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]):
                end, ev, child = stack.pop()
                out[ev["name"]][0] += ev.get("dur", 0) - child
                out[ev["name"]][1] += 1
                if stack:
                    stack[-1][2] += ev.get("dur", 0)
            if e is not None:
                stack.append([e["ts"] + e.get("dur", 0), e, 0.0])
    return out


def kernel_table(trace_path: str, top: int = 25) -> tuple[list[str], dict]:
    """(lines, counts) of a torch.profiler trace: GPU kernels by time, CUDA runtime/driver calls (the host
    side of launches, copies and syncs), host ops by self time."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    groups = {"kernel": collections.defaultdict(lambda: [0.0, 0]), "runtime": collections.defaultdict(lambda: [0.0, 0])}
    for e in events:
        cat = e.get("cat", "")
        key = "kernel" if cat == "kernel" else "runtime" if cat in ("cuda_runtime", "cuda_driver") else None
        if key:
            groups[key][e["name"]][0] += e.get("dur", 0)
            groups[key][e["name"]][1] += 1
    host = _self_times([e for e in events if e.get("cat") == "cpu_op"])
    # the trainer marks each profiled step with a "step N" range; the trace's span if it did not
    steps = [e for e in events if e.get("cat") == "user_annotation" and re.fullmatch(r"step \d+", e["name"])]
    wall = sum(e.get("dur", 0) for e in steps) or (max(e["ts"] + e.get("dur", 0) for e in events)
                                                   - min(e["ts"] for e in events))
    counts = {name: sum(c for _, c in g.values()) for name, g in (*groups.items(), ("host_ops", host))}
    kernel_us = sum(d for d, _ in groups["kernel"].values())
    lines = [f"profile: {os.path.basename(trace_path)}; {len(steps)} profiled step(s), {wall / 1e3:.1f} ms of wall time",
             f"GPU kernels: {counts['kernel']} launches, {kernel_us / 1e3:.1f} ms of kernel time"]
    titles = (("kernel", "top GPU kernels (total time)", top), ("runtime", "CUDA runtime/driver calls (host)", 15),
              ("host_ops", "host ops (self time)", 15))
    for key, title, n in titles:
        table = host if key == "host_ops" else groups[key]
        total = sum(d for d, _ in table.values()) or 1.0
        lines.append(f"{title}: {counts[key]} calls")
        for name, (d, c) in sorted(table.items(), key=lambda kv: -kv[1][0])[:n]:
            lines.append(f"  {d / 1e3:10.2f} ms {100 * d / total:5.1f}% x{c:<7d} {name[:120]}")
    counts.update(kernel_ms=kernel_us / 1e3, profiled_wall_ms=wall / 1e3, profiled_steps=len(steps))
    return lines, counts
