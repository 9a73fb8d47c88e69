"""Checkpoint folder rules (no processes): only complete checkpoints are ever picked up."""

import json
import os

import pytest

from mimo_sft.errors import UserError
from mimo_sft.train.checkpoint.files import LATEST, resolve_checkpoint


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


# ---- publishing: latest always names a complete checkpoint ------------------------------------------
from mimo_sft.train.checkpoint.files import complete_checkpoints, latest_name, prune, publish  # noqa: E402


def _finished_tmp(root, step, marker):
    tmp = os.path.join(root, f"iter_{step:07d}.tmp")
    os.makedirs(os.path.join(tmp, "model"))
    with open(os.path.join(tmp, "model", "weights"), "w") as fh:
        fh.write(marker)
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump({"step": step}, fh)
    return tmp


def _marker(folder):
    with open(os.path.join(folder, "model", "weights")) as fh:
        return fh.read()


def test_publish_moves_latest_to_a_complete_folder(tmp_path):
    root = str(tmp_path)
    first = publish(root, _finished_tmp(root, 2, "a"), 2)
    assert os.path.basename(first) == "iter_0000002" and latest_name(root) == "iter_0000002"
    second = publish(root, _finished_tmp(root, 4, "b"), 4)
    assert resolve_checkpoint(root) == second and os.path.isdir(first)  # older ones kept by default
    assert not os.path.exists(os.path.join(root, LATEST + ".tmp"))


def test_resaving_a_step_never_deletes_what_latest_names(tmp_path):
    """A run resumed from step 2 reaches step 4 again: the new save gets its own name, latest moves
    to it, and only then the old step-4 folder goes."""
    root = str(tmp_path)
    publish(root, _finished_tmp(root, 2, "a"), 2)
    old = publish(root, _finished_tmp(root, 4, "old"), 4)
    new = publish(root, _finished_tmp(root, 4, "new"), 4)
    assert os.path.basename(new) == "iter_0000004.v2"
    assert resolve_checkpoint(root) == new and _marker(new) == "new"
    assert not os.path.exists(old)
    again = publish(root, _finished_tmp(root, 4, "newer"), 4)
    assert os.path.basename(again) == "iter_0000004" and _marker(resolve_checkpoint(root)) == "newer"
    assert [n for _s, _v, n in complete_checkpoints(root)] == ["iter_0000002", "iter_0000004"]


def test_keep_last_prunes_only_after_a_newer_save_is_complete(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        publish(root, _finished_tmp(root, step, str(step)), step, keep_last=2)
    assert [s for s, _v, _n in complete_checkpoints(root)] == [2, 3]
    make_ckpt(root, 5, complete=False)  # an unfinished save is neither counted nor removed
    assert prune(root, 1) == ["iter_0000002"]
    assert os.path.isdir(os.path.join(root, "iter_0000005.tmp"))
    with open(os.path.join(root, LATEST), "w") as fh:  # latest is never pruned, even when older
        fh.write("iter_0000003")
    publish(root, _finished_tmp(root, 4, "4"), 4)
    with open(os.path.join(root, LATEST), "w") as fh:
        fh.write("iter_0000003")
    assert prune(root, 1) == [] and resolve_checkpoint(root).endswith("iter_0000003")
