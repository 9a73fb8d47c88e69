"""Read back what the real tracker packages wrote (no network): a W&B offline run file and an MLflow
folder store."""

from __future__ import annotations

import glob
import json
import os
import struct


def wandb_offline_run(save_dir: str) -> dict:
    """The one offline run under ``save_dir``: ``{"project", "name", "config", "history": [row, ...]}``.

    A ``.wandb`` file is a LevelDB-style log (a 7-byte ``:W&B`` header, 32 KiB blocks, records of
    checksum/length/type + data, split over blocks as FIRST/MIDDLE/LAST) of wandb's ``Record`` protobufs.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    out = {"history": [], "config": {}}
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(project=rec.run.project, name=rec.run.display_name)
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return out


def mlflow_runs(uri: str, experiment: str) -> list[dict]:
    """Every run of ``experiment``: ``{"name", "params", "status", "metrics": {key: {step: value}}}``."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} in {uri}"
    out = []
    for run in client.search_runs([exp.experiment_id]):
        metrics = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}
        out.append({"name": run.info.run_name, "params": dict(run.data.params), "status": run.info.status,
                    "metrics": metrics})
    return out
