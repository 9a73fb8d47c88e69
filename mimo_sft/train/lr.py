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


def set_lr(optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value
