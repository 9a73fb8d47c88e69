"""Experiment trackers: Weights & Biases and MLflow, fed by the rank that writes ``metrics.jsonl``.

Each tracker gets the resolved config once when it opens and then every row the run logs (the same
keys as ``metrics.jsonl``, numbers only, at the row's ``step``). Both are optional packages: which
ones a config turns on, and whether they are installed, is decided in ``config.trackers`` (check 29
names what to install before any process starts). Offline use needs no network: ``WANDB_MODE=offline``
writes the W&B run under ``--wandb-save-dir``; an MLflow URI that is a folder (or ``file:``) is a
local store.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from mimo_sft.config.trackers import enabled_trackers

DEFAULT_MLFLOW_EXPERIMENT = "mimo-sft"


class Tracker(Protocol):
    def log_metrics(self, row: dict, step: int) -> None: ...

    def close(self) -> None: ...


def numbers(row: dict) -> dict:
    """The numeric values of a metrics row (no ``step``, no ``None``; booleans as 0/1)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def flat_config(config: dict, prefix: str = "") -> dict:
    """``{"optimizer": {"lr": 1e-5}}`` -> ``{"optimizer.lr": 1e-5}``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class WandbTracker:
    def __init__(self, *, project: str, name: str, save_dir: str, config: dict):
        import wandb

        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=config)

    def log_metrics(self, row: dict, step: int) -> None:
        self.run.log(numbers(row), step=step)

    def close(self) -> None:
        """Finish the run, then stop wandb's service process, so that the run's ``.wandb`` file is complete
        when this returns.

        ``finish()`` returns once wandb-core has answered the exit record, but wandb-core keeps the file's
        records in memory (only the header is on disk) until it closes the run's stream, on a message that
        ``finish()`` sends without waiting for it. A rank that leaves right after (``launch._abort`` uses
        ``os._exit``, which skips wandb's atexit teardown) leaves wandb-core to see its parent gone and stop
        without writing them. ``wandb.teardown()`` waits for the service to exit, which it does only after
        it has closed that stream; a later ``wandb.init`` starts a new one."""
        import wandb

        self.run.finish()
        wandb.teardown()


class MLflowTracker:
    """One MLflow run through the client API (no process-global active run)."""

    def __init__(self, *, tracking_uri: str, experiment: str, name: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("file:"):
            # MLflow 3 refuses its folder store unless asked for it; a folder is what --mlflow-tracking-uri
            # names here (offline, no server), so ask
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in sorted(flat_config(config).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, row: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numbers(row).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_uri(logging_cfg) -> str:
    """``--mlflow-tracking-uri``, else ``MLFLOW_TRACKING_URI``, else a folder store in the output folder."""
    uri = logging_cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = os.path.join(logging_cfg.output_dir, "mlruns")
    if "://" not in uri and not uri.startswith("file:"):
        uri = "file://" + os.path.abspath(uri)
    return uri


def open_trackers(logging_cfg, config: dict) -> list:
    """The trackers ``logging_cfg`` turns on, opened with the resolved ``config`` (a nested dict)."""
    name = os.path.basename(os.path.normpath(logging_cfg.output_dir)) or "mimo-sft"
    out = []
    for tracker in enabled_trackers(logging_cfg):
        if tracker == "wandb":
            out.append(WandbTracker(project=logging_cfg.wandb_project, name=logging_cfg.wandb_exp_name or name,
                                    save_dir=logging_cfg.wandb_save_dir or os.path.join(logging_cfg.output_dir, "wandb"),
                                    config=config))
        else:
            out.append(MLflowTracker(tracking_uri=mlflow_uri(logging_cfg),
                                     experiment=logging_cfg.mlflow_experiment or DEFAULT_MLFLOW_EXPERIMENT,
                                     name=name, config=config))
    return out
