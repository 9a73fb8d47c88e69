"""Which experiment trackers a config turns on, and which of their packages are missing.

Pure: a package is looked up with ``importlib.util.find_spec`` (nothing is imported), so ``validate``
can name what to install before any process starts. The trackers themselves are ``train.trackers``.
"""

from __future__ import annotations

import importlib.util

#: tracker -> (the flag that turns it on, the module it imports, the package that provides it)
TRACKERS = {
    "wandb": ("--wandb-project", "wandb", "wandb"),
    "mlflow": ("--mlflow-tracking-uri/--mlflow-experiment", "mlflow", "mlflow-skinny"),
}


def enabled_trackers(logging_cfg) -> list[str]:
    """The trackers ``logging_cfg`` (``schema.LoggingConfig``) asks for, in a fixed order."""
    on = []
    if logging_cfg.wandb_project:
        on.append("wandb")
    if logging_cfg.mlflow_tracking_uri or logging_cfg.mlflow_experiment:
        on.append("mlflow")
    return on


def missing_tracker_packages(logging_cfg) -> list[tuple[str, str]]:
    """``(flag, package to install)`` for each enabled tracker whose package cannot be imported."""
    out = []
    for name in enabled_trackers(logging_cfg):
        flag, module, package = TRACKERS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append((flag, package))
    return out
