"""The numbered checks with check 23's forecast wired in: what ``validate``, ``finetune``, ``evaluate`` and
``plan`` call.

``config.checks.registry.check_config`` takes check 23's body as an argument because the forecast
(``memory/``) reads the config schema (``config/``): an arrow from config/ to memory/ would close a circle.
This module sits above both and is the one place that joins them. Pure like both: no torch, no megatron.
Check 23 forecasts the largest micro-batch the data's rows can form where ``check-data --write-costs`` counted
them for these settings (:func:`data_row_counts`: the cost files are named by the rows and settings, so finding
them reads no row), else the worst case a sample could reach.

``validate`` (not ``for_run``: the ranks open their sources at start-up anyway) also opens each source as far as
start-up does without converting or decoding anything -- streamed shard lists, footers and tar headers, a loaded
parquet's footers, a hub name while offline, and one ``stat`` per image and clip file (:func:`data.source_probe.
probe_sources`, checks 17 and 28) -- so that it refuses what ``finetune`` refuses. Only a config that opens a
source imports the data layer's heavy parts (transformers through the preprocessor: ``data.model_folder``).
"""

from __future__ import annotations

from functools import partial

from mimo_sft.config.checks import registry
from mimo_sft.config.checks.registry import CheckResult
from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.errors import UserError
from mimo_sft.memory.check import forecast_check

__all__ = ["CheckResult", "check_config", "require_valid"]
#: ``row_counts``' default: look for the data's cost files
LOOK = object()


def data_row_counts(cfg: ExperimentConfig):
    """``(memory.from_data.RowCounts or None, why not)``: the per-row counts check-data wrote for this data and
    these settings (``data.cost_file.load_row_counts``), which check 23 forecasts the largest micro-batch of.
    A dataset that cannot be opened has none (check 17 says why)."""
    if not cfg.model.hf_model or not (cfg.data.dataset_path or cfg.data.datasets):
        return None, None
    from mimo_sft.data import cost_file

    if not cost_file.any_written(cfg.data):
        return None, None
    from mimo_sft.data.model_folder import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset

    try:
        source = load_sft_dataset(cfg.data, check_files=False)
        pre = build_preprocessor(cfg.data, cfg.model.hf_model)
        return cost_file.load_row_counts(source, pre, cost_file.cost_dir(cfg.data))
    except (UserError, OSError, ValueError):
        return None, None


def _forecaster(cfg: ExperimentConfig, row_counts):
    counts, why = data_row_counts(cfg) if row_counts is LOOK else (row_counts, None)
    return partial(forecast_check, counts=counts, counts_note=why)


def check_config(cfg: ExperimentConfig, *, row_counts=LOOK, **kw) -> CheckResult:
    """Every numbered check (see ``config.checks.registry.check_config``), check 23 included: on the data's
    per-row counts where check-data wrote them (``row_counts``: given, or None for the worst case)."""
    result = registry.check_config(cfg, forecaster=_forecaster(cfg, row_counts), **kw)
    if not kw.get("for_run"):
        from mimo_sft.config.checks.context import Problem
        from mimo_sft.config.mixture import source_lines
        from mimo_sft.data.source_probe import probe_sources

        problems, rows = probe_sources(cfg)
        known = {p.message for p in result.problems}  # (a streamed source's refusals are check 17's too)
        result.problems.extend(Problem(n, msg) for n, msg in problems if msg not in known)
        result.notes.extend(Problem(17, line, "note") for line in source_lines(cfg, rows))
        gdn = _gdn_note(result.hf_config)
        if gdn:
            result.notes.append(Problem(16, gdn, "note"))
        if not result.problems:  # (the processor is read only for a config that is otherwise sound)
            from mimo_sft.data.model_folder import fitted_pixels_note

            fitted = fitted_pixels_note(cfg.data, cfg.model.hf_model)
            if fitted:
                result.notes.append(Problem(17, fitted, "note"))
    return result


def _gdn_note(hf_config) -> str | None:
    """For a checkpoint with Gated DeltaNet layers (Qwen3.5): which kernels run them here, and the rule."""
    from mimo_sft.config.families import family_for_model_type

    spec = family_for_model_type((hf_config or {}).get("model_type"))
    if spec is None or not spec.architecture.hybrid_gdn:
        return None
    from mimo_sft.gdn_path import validate_line

    return validate_line()


def require_valid(cfg: ExperimentConfig, *, row_counts=LOOK, **kw) -> CheckResult:
    """``check_config`` that raises one ``UserError`` listing every problem (``finetune``, ``evaluate``)."""
    return registry.require_valid(cfg, forecaster=_forecaster(cfg, row_counts), **kw)
