"""``mimo-sft check-data``: the CLI side of ``data.check`` (flags, the printed report, the exit code).

Same config flags as ``finetune`` (so the data is read with the run's seq-length, pixel bounds,
columns and image root), plus ``--workers N`` (decoding processes; default: every CPU) and
``--json``. Exit 0: every sample can be trained on; 1: problems were found (each listed with its
sample index and file); 2: a user error before any sample was read (bad flag, unreadable dataset).
No process group, no model: it runs on a login node.
"""

from __future__ import annotations

import json
import os
import sys
import time

from mimo_sft.errors import UserError

CHECK_DATA_FLAGS = {"--workers": "decoding worker processes (default: every CPU; 0: decode in this process)",
                    "--json": "print the counts and every problem as one JSON object",
                    "--write-costs": "write each source's per-row counts (real and image tokens, image grids) to "
                                     "--cost-dir, so --reorder-mode index plans without reading rows and the memory "
                                     "forecast (check 23) takes this data's largest micro-batch"}

_COUNT_TEXT = {
    "samples": "samples", "images": "images", "clips": "video clips", "clip_frames": "frames sampled from them",
    "clips_downsampled": "clips given fewer or smaller frames to fit --seq-length / --video-total-pixels",
    "text_only": "text-only samples",
    "truncated_answers": "answers cut at --seq-length (trained on their first part)",
    "empty_answers": "samples with an empty assistant answer (trained on the end-of-turn token alone)",
    "images_over_max_pixels": "images over --max-pixels (downscaled)",
    "images_under_min_pixels": "images under --min-pixels (upscaled)",
    "image_tokens_past_seq_length": "samples whose image tokens pass --seq-length (dropped or refused)",
    "bad_samples": "samples that cannot be trained on (listed above)",
}


def _split_args(args: list[str]) -> tuple[int, bool, bool, list[str]]:
    workers, as_json, costs, rest = os.cpu_count() or 1, False, False, []
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if name == "--json" and not eq:
            as_json = True
        elif name == "--write-costs" and not eq:
            costs = True
        elif name == "--workers":
            if not eq:
                i += 1
                if i >= len(args):
                    raise UserError("--workers needs a value")
            value = inline if eq else args[i]
            try:
                workers = int(value)
            except ValueError:
                raise UserError(f"--workers {value!r}: expected a number of processes") from None
            if workers < 0:
                raise UserError(f"--workers {workers} must be >= 0")
        else:
            rest.append(args[i])
        i += 1
    return workers, as_json, costs, rest


def run_check_data(args: list[str]) -> int:
    from mimo_sft.config.loader import load_config
    from mimo_sft.data.check import check_dataset
    from mimo_sft.quiet import quiet_libraries

    from mimo_sft.config.checks.registry import data_flag_problems, refuse

    workers, as_json, costs, rest = _split_args(list(args))
    cfg = load_config(rest)
    if not cfg.model.hf_model:
        raise UserError("check-data needs --hf-model DIR: the checkpoint's chat template and image processor "
                        "decide how every sample is encoded")
    if not os.path.isdir(cfg.model.hf_model):
        raise UserError(f"--hf-model {cfg.model.hf_model}: folder not found; point it at a Hugging Face Qwen-VL checkpoint folder")
    refuse(data_flag_problems(cfg))  # finetune's checks of the data flags (--video-fps 0, pixel bounds, ...)
    quiet_libraries()
    t0 = time.perf_counter()
    with Progress() as progress:
        report = check_dataset(cfg.data, model_dir=cfg.model.hf_model, workers=workers, write_costs=costs,
                               progress=progress.update)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    report["workers"] = workers
    if as_json:
        print(json.dumps(report))
    else:
        _print(report)
    return 0 if report["ok"] else 1


class Progress:
    """check-data's progress on stderr (stdout keeps the report and ``--json`` clean): a bar with the rate and
    the time left on a terminal; off one (a log, a pipe), a line every :data:`LINE_EVERY_S` seconds."""

    LINE_EVERY_S = 10.0

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.bar = self.task = None

    def __enter__(self) -> "Progress":
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            from mimo_sft.console import make_console

            self.bar = Bar(TextColumn("check-data"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
                           TimeRemainingColumn(), console=make_console(stderr=True), transient=True)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("check", total=total)
            self.bar.update(self.task, completed=done)
        elif now - self.last >= self.LINE_EVERY_S and done < total:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            print(f"check-data: {done:,} of {total:,} samples ({rate:,.0f}/s, about {(total - done) / max(rate, 1e-9):,.0f} s "
                  f"left)", file=sys.stderr, flush=True)


def _print(report: dict) -> None:
    from mimo_sft.data.check import SampleProblem

    for p in report["problems"]:
        print(f"problem: {SampleProblem(**p)}")
    counts, first = report["counts"], report["first_sample"]
    print(f"check-data {report['dataset']}: {counts['samples']:,} samples decoded in {report['seconds']:.1f} s "
          f"({report['workers']} workers; --seq-length {report['seq_length']}, pixels {report['min_pixels']:,}.."
          f"{report['max_pixels']:,}, {report['image_backend']} image backend)")
    if report.get("video"):
        v = report["video"]
        print(f"  clips: {v['fps']:g} frames per second, {v['min_frames']}..{v['max_frames']} frames, pixels "
              f"{v['min_pixels']:,}..{v['max_pixels']:,}")
    for key, text in _COUNT_TEXT.items():
        if key in ("clips", "clip_frames", "clips_downsampled") and not counts.get("clips"):
            continue
        where = f"   first: sample {first[key]}" if key in first and key not in ("samples", "images") else ""
        print(f"  {counts[key]:>12,}  {text}{where}")
    verdict = ("OK: every sample can be trained on" if report["ok"] else
               f"{len(report['problems']):,} problem(s): fix or remove those samples")
    for path in report.get("cost_files", []):
        print(f"reordering counts written: {path}")
    print(verdict)
