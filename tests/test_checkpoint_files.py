"""Checkpoint folder rules (no processes): only complete checkpoints are ever picked up."""

import json
import os

import pytest

from mimo_sft.errors import UserError
from mimo_sft.train.checkpoint import LATEST, resolve_checkpoint


def make_ckpt(root, step, *, complete=True):
    path = os.path.join(root, f"iter_{step:07d}" + ("" if complete else ".tmp"))
    os.makedirs(os.path.join(path, "model"))
    if complete:
        with open(os.path.join(path, "meta.json"), "w") as fh:
            json.dump({"step": step}, fh)
    return path


def test_partial_save_is_never_picked_up(tmp_path):
    root = str(tmp_path)
    done = make_ckpt(root, 2)
    make_ckpt(root, 4, complete=False)  # a run killed mid-save leaves only the .tmp folder
    with open(os.path.join(root, LATEST), "w") as fh:
        fh.write("iter_0000002")
    assert resolve_checkpoint(root) == done
    assert resolve_checkpoint(done) == done


def test_latest_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    root = str(tmp_path)
    make_ckpt(root, 4, complete=False)
    with open(os.path.join(root, LATEST), "w") as fh:
        fh.write("iter_0000004")
    with pytest.raises(UserError, match="incomplete or missing"):
        resolve_checkpoint(root)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="no meta.json and no 'latest'"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="folder not found"):
        resolve_checkpoint(str(tmp_path / "missing"))
