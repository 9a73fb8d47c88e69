"""Checks 26 and 27: every folder a run writes to is usable before step 0.

Why here and not at write time: a run that learns its ``--output-dir`` is a file after step 1, or
its ``--export-hf`` folder is read-only after the last step, has spent the GPU time for nothing.
``validate`` and ``finetune`` run these same checks (``config.checks.CHECKS``), so a path ``validate``
calls usable is one ``finetune`` can write.

A folder is usable when it exists as a folder we can create a file in, or when it can be created:
its first existing ancestor is a folder we can create a file in. Writability is tested by creating
(and removing) a temporary file, not only by ``os.access``: root passes ``os.access`` on a folder a
read-only or virtual file system refuses to write.
"""

from __future__ import annotations

import os
import tempfile


def _can_create_in(folder: str) -> bool:
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".mimo-sft-write-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as an output folder (one clause), or None when it can."""
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(p):
        if not os.path.isdir(p):
            return "is a file, not a folder"
        return None if _can_create_in(p) else "is a folder this user cannot write to"
    ancestor = os.path.dirname(p)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"cannot be created: {ancestor} is a file"
    if not _can_create_in(ancestor):
        return f"cannot be created: {ancestor} is not writable"
    return None


def _report(flag: str, path: str | None, what: str):
    if not path:
        return
    problem = folder_problem(path)
    if problem:
        yield f"{flag} {path} {problem}; choose a folder that can hold {what}"


def c26_run_folders(ctx):
    """The folders training writes during the run: --output-dir and the checkpoint folder."""
    cfg = ctx.cfg
    out = cfg.logging.output_dir
    yield from _report("--output-dir", out, "config.yaml, metrics.jsonl and (by default) checkpoints/")
    if cfg.checkpoint.save:
        yield from _report("--save", cfg.checkpoint.save, "the checkpoints")
    elif out and not cfg.checkpoint.no_save and folder_problem(out) is None:
        yield from _report("--output-dir", os.path.join(out, "checkpoints"), "the checkpoints (or set --save)")


#: (flag, where the config keeps it, what it holds) of the folders written after training or for debugging;
#: a new output setting (a profiler trace folder, when one exists) adds one row here
EXTRA_OUTPUTS = (
    ("--export-hf", ("checkpoint", "export_hf"), "the Hugging Face export"),
    ("--save-grads", ("logging", "save_grads"), "the per-step gradient checkpoints"),
)


def c27_extra_folders(ctx):
    """The folders written after training (export) or for debugging (gradients)."""
    for flag, (section, key), what in EXTRA_OUTPUTS:
        yield from _report(flag, getattr(getattr(ctx.cfg, section), key), what)
