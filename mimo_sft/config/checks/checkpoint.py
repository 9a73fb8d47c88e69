"""Checks 15, 24 and 34: the checkpoint flags, checkpoint-writing settings, whether ``--load-checkpoint`` can resume on this
layout, and the export's shard size.

The resharding rule lives here, pure (a checkpoint's ``meta.json`` against a layout), so that
``validate``, ``finetune`` (before any tensor is read) and ``mimo-sft checkpoint info --component``
give the same answer.
"""

from __future__ import annotations

import json
import os

from mimo_sft.config.lora import distributed_optimizer_in_use

#: the distributed optimizer's DP-only format (``train.checkpoint.optimizer``): its flat buffers
#: follow each module's TP/PP-local parameters
DP_ONLY_FORMAT = "dp_reshardable"


def reshard_problem(meta: dict, components) -> str | None:
    """Why a checkpoint with ``meta`` cannot resume on ``components`` (objects or dicts with name,
    tp, pp), or None. Weights, plain-optimizer state and the reshardable distributed-optimizer
    form resume on any layout; the DP-only form needs each module's TP and PP as saved."""
    if not meta.get("use_distributed_optimizer") or meta.get("distributed_optimizer_format") != DP_ONLY_FORMAT:
        return None
    saved = {m["name"]: m for m in meta.get("layout", [])}
    for c in components:
        name, tp, pp = (c["name"], c["tp"], c["pp"]) if isinstance(c, dict) else (c.name, c.tp, c.pp)
        was = saved.get(name)
        if was is None:
            return f"it holds no {name} module"
        if (was["tp"], was["pp"]) != (tp, pp):
            return (f"its distributed-optimizer state was saved in the DP-only form with {name} tp={was['tp']},"
                    f"pp={was['pp']}, which resumes only with that TP and PP (this layout has tp={tp},pp={pp}); "
                    f"resume on the saved TP/PP (any DP), or re-save it there with --save-reshardable")
    return None


def find_meta(path: str) -> dict | None:
    """``meta.json`` of the checkpoint ``path`` names (the folder, or the one its ``latest`` names); None if unreadable."""
    for folder in (path, os.path.join(path, _latest(path) or ""), os.path.join(path, "checkpoints", _latest(
            os.path.join(path, "checkpoints")) or "")):
        try:
            with open(os.path.join(folder, "meta.json")) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            continue
    return None


def _latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest")) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def c15_checkpoints(ctx):
    c = ctx.cfg.checkpoint
    if c.load_checkpoint and ctx.cfg.model.pretrained_checkpoint:
        yield ("--load-checkpoint and --pretrained-checkpoint are exclusive: resume a run with "
               "--load-checkpoint, or start fresh from weights with --pretrained-checkpoint")
    if c.no_save:
        t = ctx.cfg.train
        needs = [flag for flag, value in (("--save", c.save), ("--save-interval", c.save_interval),
                                          ("--export-hf", c.export_hf), ("--exit-signal-handler", t.exit_signal_handler),
                                          ("--exit-interval", t.exit_interval),
                                          ("--exit-duration-in-mins", t.exit_duration_in_mins)) if value]
        if needs:
            yield (f"--no-save with {', '.join(needs)}: those write or need a checkpoint; drop --no-save to keep "
                   f"the weights, or drop {', '.join(needs)}")
    for flag, path in (("--load-checkpoint", c.load_checkpoint), ("--pretrained-checkpoint", ctx.cfg.model.pretrained_checkpoint)):
        if path and not os.path.isdir(path):
            yield f"{flag} {path}: folder not found"


def c24_checkpoint_writing(ctx):
    c = ctx.cfg.checkpoint
    if c.async_save and not c.save_interval:
        yield ("--async-save without --save-interval: the only save is the final one, which the run waits for; "
               "add --save-interval N for background saves", "note")
    if c.save_reshardable and not distributed_optimizer_in_use(ctx.cfg):
        why = "with LoRA (its optimizer is the plain one)" if ctx.cfg.optimizer.use_distributed_optimizer else \
            "without the distributed optimizer"
        yield (f"--save-reshardable has no effect {why}: a plain optimizer's checkpoint resumes on any layout", "note")
    if c.load_checkpoint and ctx.specs and os.path.isdir(c.load_checkpoint):
        meta = find_meta(c.load_checkpoint)
        problem = reshard_problem(meta, ctx.specs) if meta else None
        if problem:
            yield f"--load-checkpoint {c.load_checkpoint}: {problem}"


def shard_size_bytes(size) -> int:
    """``--export-shard-size`` (bytes, or a size such as ``5GB``/``500MB`` as transformers' ``max_shard_size``
    takes it, parsed by huggingface_hub) -> bytes; ValueError naming the flag when it is not a positive size."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(size).strip()
    try:
        n = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"--export-shard-size {size}: give a positive size such as 5GB, 500MB or a byte count")
    return n


def c34_export_shards(ctx):
    try:
        shard_size_bytes(ctx.cfg.checkpoint.export_shard_size)
    except ValueError as err:
        yield str(err)
