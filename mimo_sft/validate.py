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
        gdn = _gdn_note(result.hf_config)
        if gdn:
            result.notes.append(Problem(16, gdn, "note"))
        if not result.problems:  # (the processor is read only for a config that is otherwise sound)
            from mimo_sft.data.loader import fitted_pixels_note

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


def require_valid(cfg: ExperimentConfig, **kw) -> CheckResult:
    """``check_config`` that raises one ``UserError`` listing every problem (``finetune``, ``evaluate``)."""
    return registry.require_valid(cfg, forecaster=forecast_check, **kw)
