"""``mimo-sft summarize RUN``: a run folder's metrics.jsonl in a few lines, and where each rank's time went.

The first lines are the run's course: loss at the start and the end, the vision-load spread, speed, memory,
validation. Then, for a run of several ranks, the straggler report's per-rank figures (``train.straggler``,
logged every ``--log-interval`` steps) as a table: each rank's mean step time, its work (the step time less its
waits on other ranks), its waits, the phase it spends most in, and how often it was the slowest rank. A PNG of
the spread of work per step over the run (the band from the least to the most busy rank, the median, the step
time, and the rank most often slowest) is written with ``--png`` (to ``RUN/rank_spread.png``, or ``--png-path``).

A run resumed on another layout has steps of each (``world_size`` in each row; rows logged before that key by
their per-rank figures): the loss and validation lines cover every step, the speed, memory and per-rank figures
only the last layout's steps, and a line says where the layout changed.

Reads only the files; imports no torch.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter

from mimo_sft.errors import UserError
from mimo_sft.train.straggler import WAITS


def read_rows(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{path} not found: the fine-tune did not log any step (give the run's --output-dir)")
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill
    return rows


def layout_spans(steps: list[dict]) -> list[tuple[int, int, int | None]]:
    """``(first step, last step, ranks)`` of each run of consecutive training rows on one layout: ``world_size``,
    else the number of per-rank figures; a row with neither (an older run's step between log steps) continues the
    span before it."""
    spans: list[list] = []
    for r in steps:
        ranks = r.get("world_size") or (len(r["rank_work_s"]) if "rank_work_s" in r else None)
        if spans and (ranks is None or spans[-1][2] in (None, ranks)):
            spans[-1][1] = r["step"]
            spans[-1][2] = spans[-1][2] or ranks
        else:
            spans.append([r["step"], r["step"], ranks])
    return [tuple(s) for s in spans]


def _span_text(span) -> str:
    first, last, ranks = span
    where = "an unknown layout" if ranks is None else f"{ranks} rank{'s' if ranks != 1 else ''}"
    return f"step{'s' if last != first else ''} {first}{f'-{last}' if last != first else ''} on {where}"


def course_lines(run: str, rows: list[dict], since_step: int = 0) -> list[str]:
    """The run's course: loss, vision load, speed, memory, validation; the speed and memory of steps from
    ``since_step`` on (the last layout's)."""
    evaluations = [r for r in rows if "valid_loss" in r]
    rows = [r for r in rows if "loss" in r]  # training steps (evaluations have their own rows)
    if not rows:
        raise UserError(f"{os.path.join(run, 'metrics.jsonl')} has no training step")
    k = max(1, len(rows) // 5)
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    out = [f"steps: {len(rows)}   loss: {first:.3f} (mean of first {k}) -> {last:.3f} (mean of last {k})"
           f"   {'falling' if last < first else 'NOT falling'}"]
    rows = [r for r in rows if r["step"] >= since_step]
    before = [v for r in rows if (v := r.get("vision_load_max_over_mean_before")) is not None]
    after = [v for r in rows if (v := r.get("vision_load_max_over_mean_after")) is not None]
    if before:
        line = f"heaviest vision rank / mean vision load: {sum(before) / len(before):.3f} without reordering"
        if after:
            line += f", {sum(after) / len(after):.3f} with reordering"
        out.append(line)
    steady = rows[1:] or rows

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in steady) / len(steady)

    out.append(f"mean step time {mean('step_time_s'):.3f} s, {mean('tokens_per_s'):.0f} tokens/s, reorder exchange "
               f"{mean('reorder_exchange_s') * 1000:.1f} ms/step (on the background thread when overlapped), training "
               f"loop waited {mean('reorder_wait_s') * 1000:.1f} ms/step for it, padding "
               f"{100 * mean('padding_fraction'):.1f} % of language positions")
    tflops = [r["model_tflops_per_gpu"] for r in steady if r.get("model_tflops_per_gpu") is not None]
    if tflops:
        mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
        out.append(f"model {sum(tflops) / len(tflops):.2f} TFLOP/s per GPU"
                   + (f", MFU {100 * sum(mfu) / len(mfu):.1f} %" if mfu
                      else " (MFU: unknown peak; pass --peak-tflops)"))
    peaks = {k[len("peak_memory_bytes_"):]: max(r.get(k, 0) for r in rows) for k in rows[-1]
             if k.startswith("peak_memory_bytes_")}
    if peaks:
        out.append("peak memory per module (largest rank, GiB): "
                   + ", ".join(f"{name} {value / 2**30:.2f}" for name, value in peaks.items()))
    if evaluations:
        out.append(f"valid loss: {evaluations[0]['valid_loss']:.3f} after step {evaluations[0]['step']} -> "
                   f"{evaluations[-1]['valid_loss']:.3f} after step {evaluations[-1]['step']} "
                   f"({len(evaluations)} evaluations)")
    return out


def rank_rows(rows: list[dict]) -> list[dict]:
    """The log steps that carry the straggler report's per-rank figures."""
    return [r for r in rows if "loss" in r and "rank_work_s" in r]


def rank_table(logged: list[dict]) -> list[str]:
    """One line per rank: mean step, work and wait seconds per step, its busiest phase, times slowest."""
    n = len(logged[0]["rank_work_s"])
    slow = Counter(r["slowest_rank"] for r in logged if "slowest_rank" in r)
    lines = [f"per rank, mean over {len(logged)} log intervals (seconds per step; work = step less waits on other "
             f"ranks):", f"{'rank':>5} {'step':>8} {'work':>8} {'waits':>8}  {'busiest phase':<26} slowest"]
    for rank in range(n):
        step = statistics.fmean(r["rank_step_s"][rank] for r in logged)
        work = statistics.fmean(r["rank_work_s"][rank] for r in logged)
        phases = {p: statistics.fmean(r["rank_phase_s"][p][rank] for r in logged) for p in logged[0]["rank_phase_s"]}
        busiest = max((p for p in phases if p not in WAITS), key=lambda p: phases[p])
        waits = sum(v for p, v in phases.items() if p in WAITS)
        lines.append(f"{rank:>5} {step:>8.3f} {work:>8.3f} {waits:>8.3f}  {busiest + f' {phases[busiest]:.3f}':<26} "
                     f"{slow.get(rank, 0)}/{len(logged)}")
    return lines


def write_png(logged: list[dict], path: str) -> str:
    """Work per step across the ranks over the run: min-max band, median, step time, the most often slowest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in logged]
    works = [r["rank_work_s"] for r in logged]
    slow = Counter(r["slowest_rank"] for r in logged if "slowest_rank" in r)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.fill_between(steps, [min(w) for w in works], [max(w) for w in works], color="tab:blue", alpha=0.2,
                    label="work per step: least to most busy rank")
    ax.plot(steps, [statistics.median(w) for w in works], color="tab:blue", lw=1.5, label="median rank's work")
    ax.plot(steps, [statistics.median(r["rank_step_s"]) for r in logged], color="black", lw=1.0, ls=":",
            label="step time")
    if slow:
        rank, times = slow.most_common(1)[0]
        ax.plot(steps, [w[rank] for w in works], color="tab:red", lw=1.5,
                label=f"rank {rank} (slowest at {times} of {len(logged)} log steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(f"mimo-sft: spread of work per step over {len(works[0])} ranks", loc="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(run: str, png: str | None = None) -> list[str]:
    """Every line ``mimo-sft summarize`` prints; with ``png`` (a path; ``""``: ``RUN/rank_spread.png``) it writes
    the plot where there are per-rank figures."""
    rows = read_rows(run)
    spans = layout_spans([r for r in rows if "loss" in r])
    since = spans[-1][0] if spans else 0
    lines = course_lines(run, rows, since_step=since)
    if len(spans) > 1:
        lines.insert(1, f"the layout changed: {', '.join(_span_text(s) for s in spans)}; speed, memory and per-rank "
                        f"figures below are of {_span_text(spans[-1])}")
    logged = [r for r in rank_rows(rows) if r["step"] >= since]
    if logged:
        lines += rank_table(logged)
        if png is None:
            default = os.path.join(run, "rank_spread.png")
            lines.append(f"plot of the spread of work per step: add --png (writes {default})")
        else:
            try:
                path = write_png(logged, png or os.path.join(run, "rank_spread.png"))
                lines.append(f"spread of work per step over the run: {path}")
            except ImportError:
                lines.append("no plot: matplotlib is not installed (pip install matplotlib)")
    else:
        lines.append("no per-rank figures (a run of one rank, or logged before the straggler report)")
    lines.append(f"metrics: {os.path.join(run, 'metrics.jsonl')}; checkpoints: {os.path.join(run, 'checkpoints')}")
    return lines
