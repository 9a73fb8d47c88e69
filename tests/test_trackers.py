"""W&B and MLflow, offline, with the real packages: the metrics rank's logger hands each tracker the
resolved config once and every row it writes to metrics.jsonl; a missing package is one line from
``validate`` (check 29)."""

import json
import os
import signal
import threading

import pytest

from mimo_sft.config import trackers as tracker_cfg
from mimo_sft.validate import check_config
from mimo_sft.config.schema import ExperimentConfig, LoggingConfig
from mimo_sft.train.metrics import MetricsLogger
from mimo_sft.train.trackers import WandbTracker, open_trackers
from tracker_helpers import mlflow_runs, wandb_offline_run


def _rows():
    return [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": None, "update_ok": True, "note": "x"}
            for s in (1, 2, 3)]


def test_logger_sends_config_and_every_row_to_both_trackers(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "run")
    lg = LoggingConfig(output_dir=out, wandb_project="proj", wandb_exp_name="exp1",
                       mlflow_tracking_uri=str(tmp_path / "mlruns"), mlflow_experiment="sft")
    config = {"optimizer": {"lr": 1e-3}, "logging": {"output_dir": out}}
    logger = MetricsLogger(out, enabled=True, total_steps=3, tensorboard=False, trackers=open_trackers(lg, config))
    for row in _rows():
        logger.write_row(row, row["step"])
    logger.close()
    written = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in written] == [1, 2, 3]

    # read at once, as a rank that exits right after close() leaves it: close() must not return before
    # wandb-core has written the run's records (finish() alone returns while only the header is on disk)
    wb = wandb_offline_run(os.path.join(out, "wandb"))
    assert (wb["project"], wb["name"]) == ("proj", "exp1")
    assert wb["config"]["optimizer"]["lr"] == 1e-3, wb["config"]
    assert [(h["_step"], h["loss"], h["update_ok"]) for h in wb["history"]] == [(s, 5.0 / s, 1.0) for s in (1, 2, 3)]
    assert all("grad_norm" not in h and "note" not in h for h in wb["history"])

    (ml,) = mlflow_runs("file://" + str(tmp_path / "mlruns"), "sft")
    assert ml["status"] == "FINISHED" and ml["name"] == "run"
    assert ml["params"]["optimizer.lr"] == "0.001"
    assert ml["metrics"]["loss"] == {1: 5.0, 2: 2.5, 3: 5.0 / 3}
    assert set(ml["metrics"]) == {"loss", "lr", "update_ok"}


def test_wandb_run_file_is_complete_when_close_returns_even_if_wandb_core_lags(tmp_path, monkeypatch):
    """wandb-core writes an offline run's records only when it handles finish()'s last message, which
    finish() does not wait for; under load it handles it late. Pausing the service (SIGSTOP, 0.5 s) just
    before that message makes the lag certain: with ``run.finish()`` alone only the file's header is there."""
    import psutil
    from wandb.sdk.lib.service import service_connection

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    inform_finish = service_connection.ServiceConnection.inform_finish

    def lagging(self, run_id):
        cores = [p for p in psutil.Process().children() if "wandb-core" in p.name()]
        assert cores, "no wandb-core child process to pause"
        for core in cores:
            core.send_signal(signal.SIGSTOP)
            threading.Timer(0.5, core.send_signal, (signal.SIGCONT,)).start()
        inform_finish(self, run_id)

    monkeypatch.setattr(service_connection.ServiceConnection, "inform_finish", lagging)
    tracker = WandbTracker(project="proj", name="lag", save_dir=str(tmp_path), config={"seed": 7})
    tracker.log_metrics({"step": 1, "loss": 2.0}, 1)
    tracker.close()
    wb = wandb_offline_run(str(tmp_path))
    assert (wb["project"], wb["name"], wb["config"]["seed"]) == ("proj", "lag", 7), wb
    assert [(h["_step"], h["loss"]) for h in wb["history"]] == [(1, 2.0)]


def test_disabled_logger_opens_no_tracker_files(tmp_path):
    logger = MetricsLogger(str(tmp_path / "r"), enabled=False, total_steps=1, trackers=["never used"])
    assert logger.trackers == []


def test_missing_tracker_package_is_one_line(monkeypatch):
    monkeypatch.setitem(tracker_cfg.TRACKERS, "mlflow", ("--mlflow-tracking-uri/--mlflow-experiment",
                                                          "mimo_sft_no_such_module", "mlflow-skinny"))
    cfg = ExperimentConfig()
    cfg.logging.mlflow_experiment = "sft"
    cfg.logging.wandb_exp_name = "orphan"
    msgs = [p.message for p in check_config(cfg).problems if p.check == 29]
    assert any("needs the mlflow-skinny package" in m and "pip install mlflow-skinny" in m for m in msgs), msgs
    assert any(m.startswith("--wandb-exp-name without --wandb-project") for m in msgs), msgs
    assert all("\n" not in m for m in msgs)


@pytest.mark.parametrize("flags, needle", [
    ({"vision_lr": -1.0}, "--vision-lr=-1.0 must be >= 0"),
    ({"projector_lr": 1e-4, "freeze_projector": True}, "--projector-lr is set but the patch merger"),
    ({"vision_lr": 1e-4, "freeze_vision": True}, "--vision-lr is set but the vision tower does not train"),
    ({"weight_decay": -0.1}, "--weight-decay=-0.1 must be >= 0"),
])
def test_learning_rate_mistakes_are_refused(flags, needle):
    cfg = ExperimentConfig()
    for key, value in flags.items():
        setattr(cfg.model if key.startswith("freeze") else cfg.optimizer, key, value)
    msgs = [p.message for p in check_config(cfg).problems if p.check == 29]
    assert any(needle in m for m in msgs), msgs


def test_vision_lr_with_a_frozen_tower_but_vision_adapters_is_fine():
    cfg = ExperimentConfig()
    cfg.model.freeze_vision = True
    cfg.model.lora_rank = 4
    cfg.model.lora_target_modules = "linear_qkv,vision_attn"
    cfg.optimizer.vision_lr = 1e-4
    assert not [p for p in check_config(cfg).problems if p.check == 29]
