"""Crafted checkpoint files for the tests of ``train.checkpoint.trusted``: each keeps the file valid for
a plain ``pickle.load`` / ``torch.load(weights_only=False)`` -- the load would succeed and training would
go on -- while running a shell command that creates ``marker`` the moment it is unpickled."""

from __future__ import annotations

import io
import os
import pickle
import shutil

import torch


class Payload:
    """Unpickled, it runs ``touch MARKER`` (``os.system``) and becomes its exit status."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def copy_checkpoint(ckpt: str, dest: str) -> str:
    shutil.copytree(ckpt, dest)
    return dest


def plant_metadata(part: str, marker: str) -> str:
    """The part's ``.metadata`` with the payload in its ``storage_meta.modules`` list (torch's own metadata
    otherwise unchanged: a plain unpickler loads it and the load proceeds). Returns the file."""
    path = os.path.join(part, ".metadata")
    with open(path, "rb") as fh:
        metadata = pickle.load(fh)
    metadata.storage_meta.modules = [Payload(marker)]
    with open(path, "wb") as fh:
        pickle.dump(metadata, fh)
    return path


def plant_rank_file(ckpt: str, marker: str, rank: int = 0) -> str:
    """``rank_NNNNN.pt`` with the payload beside the RNG state. Returns the file."""
    path = os.path.join(ckpt, f"rank_{rank:05d}.pt")
    state = torch.load(path, weights_only=False)
    state["note"] = Payload(marker)
    torch.save(state, path)
    return path


def plant_object(part: str, marker: str, suffix: str = "common/shard_0_1") -> str:
    """One stored object of the part (a megatron ShardedObject's bytes, the first whose key ends with
    ``suffix``) replaced by a torch-saved payload appended to its data file; the metadata points at it.
    Returns the data file."""
    path = os.path.join(part, ".metadata")
    with open(path, "rb") as fh:
        metadata = pickle.load(fh)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.endswith(suffix))
    blob = io.BytesIO()
    torch.save([Payload(marker)], blob)
    data_file = os.path.join(part, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as fh:
        fh.write(blob.getvalue())
    info.offset, info.length = offset, len(blob.getvalue())
    with open(path, "wb") as fh:
        pickle.dump(metadata, fh)
    return data_file


#: each file a load reads that can carry a pickle: name -> planter(checkpoint, marker) -> the planted file
PLANTS = {
    "model_metadata": lambda ck, m: plant_metadata(os.path.join(ck, "model"), m),
    "optimizer_metadata": lambda ck, m: plant_metadata(os.path.join(ck, "optimizer"), m),
    "optimizer_object": lambda ck, m: plant_object(os.path.join(ck, "optimizer"), m),
    "rank_file": plant_rank_file,
}


def planted(ckpt: str, tmp_path, kind: str) -> tuple[str, str, str]:
    """A copy of ``ckpt`` with the ``kind`` payload: (its folder, the marker the payload would create,
    the path of the refused file)."""
    folder = copy_checkpoint(ckpt, str(tmp_path / f"planted_{kind}" / os.path.basename(ckpt)))
    marker = str(tmp_path / f"ran_{kind}")
    return folder, marker, PLANTS[kind](folder, marker)


def assert_refused(proc, refused_file: str, marker: str, *, code: int | None = 2) -> None:
    """The command refused the planted file: no marker, its exit code (``code``; None: any failure), one
    error line naming the file and the class, no traceback of ours (torchrun's agent prints its own after)."""
    out = proc.stdout + proc.stderr
    assert not os.path.exists(marker), f"the payload ran:\n{out[-3000:]}"
    assert proc.returncode == code if code is not None else proc.returncode != 0, (proc.returncode, out[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:") and "refused to load" in ln]
    assert errors and all(refused_file in ln and "refused to load posix.system" in ln for ln in errors), out[-3000:]
    ours = proc.stderr.split("torch/distributed/elastic")[0]
    assert "Traceback" not in ours, out[-3000:]
