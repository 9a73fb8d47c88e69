"""What a checkpoint records that a run starting from it takes when no flag gives it, and what must agree.

A checkpoint's ``meta.json`` records its LoRA settings (``lora``: rank, alpha, dropout, targets and freeze flags)
and its learning-rate schedule (``lr_schedule``: warm-up and decay length). A run that resumes from it
(``--load-checkpoint``) or starts from its weights (``--pretrained-checkpoint``; ``mimo-sft evaluate CHECKPOINT``
loads it so) takes what it needs of them unless the user gave that key -- a flag, or a key of the YAML
(``ExperimentConfig.given``):

* the LoRA settings, on resume and from weights alike (a LoRA checkpoint's adapters load only into adapters of
  its rank, alpha and targets); the freeze flags on resume (they decide what the checkpoint holds);
* the LR schedule on resume: the recorded warm-up and decay length, so another ``--train-iters`` continues the
  same schedule (steps past its decay stay at ``--min-lr``); ``--lr-decay-iters`` given re-stretches it.

An explicit key that differs from the checkpoint where they must agree (LoRA rank, alpha, targets; freeze flags on
resume) is refused by check 20 before any process starts (:func:`recorded_lora_problems`). What was taken is said
in one line, ``checkpoint.recorded`` (the banner, validate's note, evaluate's line). Pure: reads meta.json only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mimo_sft.config.lora import split_targets

#: meta.json's key for the LR schedule a run followed (written by ``train.checkpoint.save``)
SCHEDULE_KEY = "lr_schedule"
#: ModelConfig's LoRA keys -> meta.json ``lora`` keys
LORA_KEYS = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_target_modules": "targets"}
FREEZE_KEYS = ("freeze_vision", "freeze_projector", "freeze_language")


def lr_decay_length(cfg) -> int:
    """Steps over which the learning rate warms up and decays: ``--lr-decay-iters``, default ``--train-iters``."""
    return cfg.optimizer.lr_decay_iters or cfg.train.train_iters


def schedule_meta(cfg) -> dict:
    """What a save records so that a resume continues the schedule (:func:`take_recorded`)."""
    return {SCHEDULE_KEY: {"warmup_iters": cfg.optimizer.lr_warmup_iters, "decay_iters": lr_decay_length(cfg)}}


def starting_checkpoint(cfg) -> Optional[tuple[str, bool]]:
    """``(folder, resume)`` of the checkpoint the run starts from (``resume``: ``--load-checkpoint``), or None."""
    if cfg.checkpoint.load_checkpoint and cfg.checkpoint.load_checkpoint != "auto":
        return cfg.checkpoint.load_checkpoint, True
    if cfg.model.pretrained_checkpoint:
        return cfg.model.pretrained_checkpoint, False
    return None


def starting_meta(cfg) -> Optional[dict]:
    """The meta.json of :func:`starting_checkpoint` (None: no checkpoint, or none readable there)."""
    from mimo_sft.config.checks.checkpoint import find_meta

    start = starting_checkpoint(cfg)
    return find_meta(start[0]) if start else None


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _value(key: str, value) -> str:
    if key == "lora_target_modules":
        return ",".join(split_targets(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _lora(cfg, saved: dict, resume: bool) -> tuple[dict, list[str]]:
    """The model keys to take from the checkpoint's ``lora`` record, and how the line says them."""
    given = cfg.given
    if ("model", "lora_rank") in given and int(cfg.model.lora_rank or 0) <= 0:
        return {}, []  # LoRA turned off explicitly: check 20 says why that cannot load this checkpoint
    take = {key: (",".join(saved[m]) if key == "lora_target_modules" else saved[m])
            for key, m in LORA_KEYS.items() if ("model", key) not in given and m in saved}
    said = [f"{_flag(k)} {_value(k, v)}" for k, v in take.items()]
    if resume:
        freeze = {k: bool(saved[k]) for k in FREEZE_KEYS if k in saved and ("model", k) not in given}
        take.update(freeze)
        said += [_flag(k) for k, on in freeze.items() if on]
    return take, [f"LoRA settings from the checkpoint: {' '.join(said)}"] if said else []


def _schedule(cfg, saved: Optional[dict]) -> tuple[dict, list[str]]:
    """The optimizer keys to take from the checkpoint's ``lr_schedule`` record, and how the line says them."""
    o, t, given = cfg.optimizer, cfg.train, cfg.given
    explicit = ("optimizer", "lr_decay_iters") in given
    if saved is None:
        return {}, [] if explicit else [f"the checkpoint records no LR schedule (an older mimo-sft): it decays over "
                                        f"--train-iters {t.train_iters}"]
    take = {}
    if ("optimizer", "lr_warmup_iters") not in given:
        take["lr_warmup_iters"] = int(saved["warmup_iters"])
    warmup = take.get("lr_warmup_iters", o.lr_warmup_iters)
    if o.lr_decay_style == "constant" and warmup == 0:
        return take, []  # no schedule to speak of
    if explicit:
        if o.lr_decay_iters == saved["decay_iters"]:
            return take, [f"LR schedule: the checkpoint's (warm-up {warmup}, decay over {o.lr_decay_iters} steps)"]
        return take, [f"LR schedule re-stretched by --lr-decay-iters {o.lr_decay_iters} (warm-up {warmup}; the "
                      f"checkpoint's decayed over {saved['decay_iters']} steps)"]
    decay = int(saved["decay_iters"])
    take["lr_decay_iters"] = decay
    line = f"LR schedule from the checkpoint: warm-up {warmup}, decay over {decay} steps"
    if t.train_iters > decay:
        line += (f"; steps {decay + 1}-{t.train_iters} stay at --min-lr {o.min_lr:g} (--lr-decay-iters "
                 f"{t.train_iters} re-stretches it)")
    return take, [line]


def take_recorded(cfg):
    """``cfg`` with what its starting checkpoint records filled in where no key was given, and
    ``checkpoint.recorded`` saying what was taken (see the module docstring)."""
    start = starting_checkpoint(cfg)
    meta = starting_meta(cfg) if start else None
    if meta is None:
        return cfg
    _, resume = start
    model, lines = _lora(cfg, meta["lora"], resume) if isinstance(meta.get("lora"), dict) else ({}, [])
    optimizer = {}
    if resume:
        schedule = meta.get(SCHEDULE_KEY)
        optimizer, said = _schedule(cfg, schedule if isinstance(schedule, dict) else None)
        lines += said
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **model), optimizer=dataclasses.replace(cfg.optimizer, **optimizer),
        checkpoint=dataclasses.replace(cfg.checkpoint, recorded="; ".join(lines)))
