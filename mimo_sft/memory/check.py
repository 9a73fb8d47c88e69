"""Check 23's body: the memory forecast of every module's most loaded rank fits one GPU.

It lives here, beside the forecast, and reaches the numbered checks as ``CheckContext.forecaster``
(``mimo_sft.validate`` passes it), so that config/ never imports memory/.

Runs ``memory.forecast`` on ``--hf-model``'s config.json (no weights read) for the checked layout, on
the kernels of the device the run will use (``memory.gpu.forecast_device``: CUDA unless a run starts here
on the CPU);
a GPU group over ``--gpu-memory-gb`` (default: this machine's GPU, else 80 GiB) is an error that
names the module, the forecast, its largest terms and the cheapest fix (``memory.fixes``). The
forecast is kept on the check context so ``validate`` prints its table and ``--json`` carries it.
Layouts that other checks refuse (no language module, tp not dividing the heads, ...) are not
forecast: those checks already say what to change.
"""

from __future__ import annotations

import json
import os

from mimo_sft.config import families
from mimo_sft.memory.fixes import over_budget_messages
from mimo_sft.memory.forecast import GIB, forecast_memory
from mimo_sft.memory.gpu import forecast_device, gpu_budget_bytes
from mimo_sft.parallel.layout import LANGUAGE


def processor_max_pixels(hf_dir: str | None) -> int | None:
    """The image processor's largest image area, from the folder's preprocessor/processor JSON."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            with open(os.path.join(hf_dir or "", name)) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        proc = data.get("image_processor", data)
        value = proc.get("max_pixels") or (proc.get("size") or {}).get("longest_edge")
        if value:
            return int(value)
    return None


def _forecastable(ctx) -> bool:
    cfg, layout, hf = ctx.cfg, ctx.layout, ctx.hf_config
    if hf is None or layout is None or LANGUAGE not in layout.names:
        return False
    spec = families.family_for_model_type(hf.get("model_type"))
    if spec is None or "vision_config" not in hf:
        return False
    lang = layout.spec(LANGUAGE)
    if list(families.language_divisibility_findings(spec, lang, hf)):
        return False
    return cfg.train.micro_batch_size >= 1 and cfg.train.global_batch_size >= 1 and cfg.data.seq_length >= 1


def forecast_check(ctx, counts=None, counts_note: str | None = None):
    """Check 23's findings for ``ctx`` (a ``config.checks.context.CheckContext``); sets ``ctx.memory``.
    ``counts``: the data's per-row counts (``memory.from_data.RowCounts``, from check-data's cost files), whose
    largest micro-batch is forecast instead of the worst case; ``counts_note``: why there are none, if known."""
    gb = ctx.cfg.train.gpu_memory_gb
    if gb is not None and not gb > 0:
        yield f"--gpu-memory-gb={gb} must be > 0 (the memory of one GPU in GiB, e.g. 80)"
        return
    if ctx.cfg.model.hf_model is None:
        if gb is not None:
            yield ("--gpu-memory-gb is set but there is no --hf-model: the memory forecast reads the model's "
                   "config.json; give --hf-model DIR", "note")
        return
    if not _forecastable(ctx):
        return  # check 16 (no config.json, unsupported model) or the layout checks say what to change
    proc_pixels = processor_max_pixels(ctx.cfg.model.hf_model)
    # plan hands in its data's workload: it forecasts the run on the cluster, like validate
    device = forecast_device(for_run=ctx.for_run, planning=ctx.workload is not None)
    kw = dict(processor_max_pixels=proc_pixels, device=device)
    if counts is not None and counts.unknown:  # rows nobody could count: any of them may be the worst case
        counts, counts_note = None, (f"{counts.unknown:,} rows of {', '.join(counts.files)} could not be encoded by "
                                     f"check-data (it lists them), so any of them may be as heavy as the worst case")
    if ctx.workload is not None:
        counts = None
    forecast = forecast_memory(ctx.cfg, ctx.layout, ctx.hf_config, workload=ctx.workload, counts=counts, **kw)
    budget, source = gpu_budget_bytes(gb)
    ctx.memory = forecast.report(budget, source)
    if counts is not None:
        worst = forecast_memory(ctx.cfg, ctx.layout, ctx.hf_config, **kw)
        ctx.memory["worst_case"] = {"gpu_peaks": worst.gpu_peaks(), "workload": worst.workload.source}
        line = worst_case_line(worst, forecast, budget)
        if line:
            yield line, "note"
    elif ctx.workload is None:
        yield from _no_counts_notes(ctx, forecast, budget, counts_note)
    yield from over_budget_messages(ctx.cfg, ctx.layout, ctx.hf_config, forecast, budget,
                                    processor_max_pixels=proc_pixels, counts=counts)


def worst_case_line(worst, forecast, budget: int) -> str | None:
    """The worst case's one line, where it would not fit while the data's forecast is in force: what it needs
    and what this data needs, per GPU group."""
    over = [g for g, p in worst.gpu_peaks().items() if p > budget]
    if not over:
        return None
    data = forecast.gpu_peaks()
    needs = ", ".join(f"{g} {worst.gpu_peaks()[g] / GIB:.1f} GiB" for g in over)
    has = ", ".join(f"{g} {data[g] / GIB:.1f} GiB" for g in over)
    return (f"the worst case a sample could reach (every sample --seq-length tokens, all of them image tokens) "
            f"needs {needs} per GPU, over --gpu-memory-gb {budget / GIB:g}; this data needs at most {has} "
            f"(check-data's per-row counts): the forecast from the data is in force")


def _no_counts_notes(ctx, forecast, budget: int, counts_note: str | None):
    """Where the worst case is in force and does not fit: why the data's counts are not used, if they exist."""
    if all(p <= budget for p in forecast.gpu_peaks().values()):
        return
    if counts_note:
        yield f"forecast for the worst case: {counts_note}", "note"
