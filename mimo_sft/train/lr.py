"""Learning-rate schedule: linear warmup, then cosine / linear decay to ``min_lr``, or constant.

A pure function of the step, so a resumed run needs nothing but the step count to continue the
exact schedule (no scheduler state to save or restore).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int, style: str) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if style == "constant":
        return lr
    decay_steps = max(1, total - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / decay_steps))
    if style == "linear":
        return lr - (lr - min_lr) * progress
    if style == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay style {style!r}")


def apply_schedule(optimizer, step: int, *, warmup: int, total: int, style: str, weight_decay: float) -> None:
    """Set every param group's learning rate and weight decay for optimizer step ``step``.

    Each group carries its own peak and floor (megatron's ``max_lr`` / ``min_lr``: ``--lr`` for the
    language model, ``--vision-lr`` / ``--projector-lr`` for the vision tower and the merger, see
    ``train.setup``), so every module follows the same schedule shape at its own scale. ``wd_mult`` is
    megatron's per-group weight-decay factor (0 for norms and biases): megatron's own scheduler
    applies it, and mimo-sft has no megatron scheduler, so it is applied here.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, lr=group["max_lr"], min_lr=group["min_lr"], warmup=warmup, total=total,
                            style=style)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
