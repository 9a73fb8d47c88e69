"""Checkpoint folders on disk: publish a finished save so nothing is ever lost, find the newest, prune.

Pure filesystem rules (no torch, no process groups), so every step can be tested by killing a save
at that step. The invariant: at every instant ``latest`` names a complete checkpoint (or does not
exist yet), whatever point a process is killed at.

* A save is written into ``iter_N.tmp`` (never read). :func:`publish` fsyncs every file and folder
  in it, renames it to a name no complete checkpoint uses, fsyncs the parent, then replaces
  ``latest`` atomically (a fsynced temporary file renamed over it) and fsyncs again. Only then is
  anything older removed.
* Re-saving a step that already has a folder (a run resumed from an earlier checkpoint reaches it
  again) writes ``iter_N.v2`` (``.v3``...) instead of deleting ``iter_N`` first: deleting first
  would leave ``latest`` naming a missing folder until the rename. The older copy is removed once
  ``latest`` names the new one.
* ``keep_last``: after a save is published, complete checkpoints beyond the newest ``keep_last``
  steps are removed (never the one ``latest`` names, nor the one ``best`` names).
* ``best`` (``--save-best``): the name of the checkpoint with the lowest validation loss, replaced
  atomically like ``latest`` by :func:`mark_best` once that checkpoint is published.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

from mimo_sft.errors import UserError

LATEST = "latest"
BEST = "best"
META = "meta.json"
_NAME = re.compile(r"^iter_(\d{7})(?:\.v(\d+))?$")
#: test hook: ``POINT:STEP`` names a point of a save (``start``, ``before_meta``,
#: ``before_rename``, ``after_rename``, ``after_latest``) and the step whose save SIGKILLs itself
#: there -- how the tests prove that a save killed anywhere leaves the previous checkpoint loadable
KILL_AT_ENV = "MIMO_SFT_TEST_KILL_AT"


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def kill_point(name: str, step: int) -> None:
    """Die here, as a SIGKILL would, when the test hook names this point of this step's save (on the workers'
    first start only: restarted workers, ``--max-restarts``, pass it, as after a node failure)."""
    from mimo_sft.train.elastic import attempt

    if os.environ.get(KILL_AT_ENV) == f"{name}:{step}" and attempt() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Persist a folder's entries (new names, renames) -- a file's own fsync does not cover them."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for folder, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text``: readers see the old or the new content, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def complete_checkpoints(root: str) -> list[tuple[int, int, str]]:
    """``(step, version, folder name)`` of every complete checkpoint under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.isfile(os.path.join(root, name, META)):
            found.append((int(m.group(1)), int(m.group(2) or 1), name))
    return sorted(found)


def latest_name(root: str, pointer: str = LATEST) -> str | None:
    """The folder name ``latest`` (or another pointer file, e.g. ``best``) names, or None."""
    path = os.path.join(root, pointer)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return fh.read().strip() or None


def _unused_name(root: str, step: int) -> str:
    base = os.path.basename(iter_dir(root, step))
    if not os.path.exists(os.path.join(root, base)):
        return base
    version = 2
    while os.path.exists(os.path.join(root, f"{base}.v{version}")):
        version += 1
    return f"{base}.v{version}"


def publish(root: str, tmp: str, step: int, *, keep_last: int | None = None) -> str:
    """Make the finished save in ``tmp`` the checkpoint of ``step`` and point ``latest`` at it.

    Called on one rank after every rank has written and fsynced its files. Returns the folder.
    """
    assert os.path.isfile(os.path.join(tmp, META)), f"{tmp} has no {META}: not a finished save"
    fsync_tree(tmp)
    kill_point("before_rename", step)
    final = os.path.join(root, _unused_name(root, step))
    os.rename(tmp, final)
    fsync_dir(root)
    kill_point("after_rename", step)
    write_atomic(os.path.join(root, LATEST), os.path.basename(final) + "\n")
    kill_point("after_latest", step)
    best = latest_name(root, BEST)
    for other_step, _version, name in complete_checkpoints(root):
        if other_step == step and name not in (os.path.basename(final), best):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)  # superseded copy of this step
    if keep_last:
        prune(root, keep_last)
    return final


def prune(root: str, keep_last: int) -> list[str]:
    """Remove complete checkpoints beyond the newest ``keep_last`` steps; never the one ``latest``
    or ``best`` names."""
    assert keep_last >= 1
    protected = {latest_name(root), latest_name(root, BEST)}
    steps = sorted({step for step, _v, _n in complete_checkpoints(root)})
    keep = set(steps[-keep_last:])
    removed = []
    for step, _version, name in complete_checkpoints(root):
        if step not in keep and name not in protected:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def mark_best(root: str, folder: str, *, keep_last: int | None = None) -> None:
    """Name the published checkpoint ``folder`` as ``best`` (atomically), then prune what the old
    ``best`` kept alive. Called on one rank."""
    assert os.path.isfile(os.path.join(folder, META)), f"{folder} is not a published checkpoint"
    write_atomic(os.path.join(root, BEST), os.path.basename(folder) + "\n")
    if keep_last:
        prune(root, keep_last)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder from either the folder itself or its parent (via ``latest``)."""
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path}: folder not found")
    if os.path.isfile(os.path.join(path, META)):
        return path
    name = latest_name(path)
    if name is not None:
        chosen = os.path.join(path, name)
        if os.path.isfile(os.path.join(chosen, META)):
            return chosen
        raise UserError(f"checkpoint {path}: 'latest' names {name}, which is incomplete or missing")
    nested = os.path.join(path, "checkpoints")
    if os.path.isfile(os.path.join(nested, LATEST)):  # the run's output folder: use its checkpoints
        return resolve_checkpoint(nested)
    raise UserError(f"checkpoint {path}: no meta.json and no 'latest' file; point it at a mimo-sft checkpoint folder")


def read_meta(ckpt: str) -> dict:
    with open(os.path.join(ckpt, META)) as fh:
        return json.load(fh)
