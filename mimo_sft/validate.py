"""The numbered checks with check 23's forecast wired in: what ``validate``, ``finetune``, ``evaluate`` and
``plan`` call.

``config.checks.registry.check_config`` takes check 23's body as an argument because the forecast
(``memory/``) reads the config schema (``config/``): an arrow from config/ to memory/ would close a circle.
This module sits above both and is the one place that joins them. Pure like both: no torch, no megatron.

``validate`` (not ``for_run``: the ranks open their sources at start-up anyway) also opens each streamed source
as start-up does -- shard lists, footers and tar headers, no pixels (:func:`data.streamed.open_streamed_sources`,
check 17) -- so that it refuses what ``finetune`` refuses.
"""

from __future__ import annotations

from mimo_sft.config.checks import registry
from mimo_sft.config.checks.registry import CheckResult
from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.memory.check import forecast_check

__all__ = ["CheckResult", "check_config", "require_valid"]


def check_config(cfg: ExperimentConfig, **kw) -> CheckResult:
    """Every numbered check (see ``config.checks.registry.check_config``), check 23 included."""
    result = registry.check_config(cfg, forecaster=forecast_check, **kw)
    if not kw.get("for_run"):
        from mimo_sft.config.checks.context import Problem
        from mimo_sft.config.mixture import source_lines
        from mimo_sft.data.streamed import open_streamed_sources

        problems, rows = open_streamed_sources(cfg.data)
        result.problems.extend(Problem(17, msg) for msg in problems)
        result.notes.extend(Problem(17, line, "note") for line in source_lines(cfg, rows))
        if not result.problems:  # (the processor is read only for a config that is otherwise sound)
            from mimo_sft.data.model_folder import fitted_pixels_note

            fitted = fitted_pixels_note(cfg.data, cfg.model.hf_model)
            if fitted:
                result.notes.append(Problem(17, fitted, "note"))
    return result


def require_valid(cfg: ExperimentConfig, **kw) -> CheckResult:
    """``check_config`` that raises one ``UserError`` listing every problem (``finetune``, ``evaluate``)."""
    return registry.require_valid(cfg, forecaster=forecast_check, **kw)
