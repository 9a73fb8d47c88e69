"""The reorder cost weights from a run's measured phases (``--reorder-calibrate-from RUN``), not a guess.

The planner counts a GPU's step as ``encoder weight * patches(vision slice) + language weight * real
tokens(language slice) / language tp`` (``data.reorder.colocated_plan``); only the ratio of the two weights
matters. A finished (or running) run already measured both sides: every ``--log-interval`` steps its
metrics.jsonl holds, per rank, the seconds of its encoder and language phases (``rank_phase_s``: forward plus
backward, the profiler's ``encoder *`` / ``language *`` ranges) and the work it was given (``rank_patches``,
``rank_tokens`` = real tokens over language tp), means per step (``train.straggler``). So:

    encoder seconds  = a0 + a * patches        (every rank and interval with an encoder phase)
    language seconds = b0 + b * tokens / tp    (every rank and interval with a language phase)

fitted by least squares; the intercepts absorb the per-step fixed costs (kernel launches, the merger on an
empty slice) that do not move with the load, so they stay out of the ratio. Where the load did not vary
enough to fit a slope (fewer than 3 points, a load that varies by under 5 %, a slope <= 0
or a fit with R^2 under 0.3), the ratio of the sums stands in and the report
says so. The weights are then ``encoder 1`` and ``language b / a``. Pure (JSON in, numbers out).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from mimo_sft.errors import UserError

FLAG = "--reorder-calibrate-from"
_ENCODER = ("encoder forward", "encoder backward")
_LANGUAGE = ("language forward", "language backward")
#: below this coefficient of variation of the load, or this R^2, the slope is not trusted: ratio of the sums
MIN_SPREAD, MIN_R2 = 0.05, 0.3


@dataclass(frozen=True)
class Fit:
    """Seconds per unit of load, a fixed part per step, and how it was found."""

    per_unit_s: float
    fixed_s: float
    points: int
    r2: float | None  # None: the ratio of the sums (no slope could be fitted)


@dataclass(frozen=True)
class Calibration:
    run: str
    encoder: Fit
    language: Fit

    @property
    def language_weight(self) -> float:
        """The language weight for an encoder weight of 1."""
        return self.language.per_unit_s / self.encoder.per_unit_s

    def describe(self) -> str:
        def how(f: Fit) -> str:
            return f"fit R^2 {f.r2:.2f}" if f.r2 is not None else "ratio of sums"

        return (f"calibrated from {self.run}: encoder {1e6 * self.encoder.per_unit_s:.3g} us/patch "
                f"({self.encoder.points} points, {how(self.encoder)}), language {1e6 * self.language.per_unit_s:.3g} "
                f"us/token per DP rank ({self.language.points} points, {how(self.language)}) -> encoder weight 1, "
                f"language weight {self.language_weight:.4g}")


def fit(xs: list[float], ys: list[float]) -> Fit | None:
    """``y = fixed + per_unit * x`` by least squares; the ratio of the sums where no positive slope fits."""
    pts = [(x, y) for x, y in zip(xs, ys) if x > 0 and y >= 0]
    if not pts:
        return None
    n = len(pts)
    mx, my = math.fsum(x for x, _ in pts) / n, math.fsum(y for _, y in pts) / n
    sxx = math.fsum((x - mx) ** 2 for x, _ in pts)
    sxy = math.fsum((x - mx) * (y - my) for x, y in pts)
    spread = math.sqrt(sxx / n) / mx  # the load's coefficient of variation: too flat, and a slope is noise
    if n >= 3 and spread >= MIN_SPREAD and sxy > 0:
        slope = sxy / sxx
        fixed = my - slope * mx
        syy = math.fsum((y - my) ** 2 for _, y in pts)
        r2 = (sxy * sxy / (sxx * syy)) if syy > 0 else 1.0
        if fixed >= 0 and r2 >= MIN_R2:  # a negative fixed part: the load is not what the time follows
            return Fit(slope, fixed, n, r2)
    total = math.fsum(x for x, _ in pts)
    return Fit(math.fsum(y for _, y in pts) / total, 0.0, n, None) if total > 0 else None


def read_points(run: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """(patches, encoder seconds, tokens, language seconds) of every rank and log interval of ``run``."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise UserError(f"{FLAG} {run}: no metrics.jsonl there; name the output folder of a finetune run")
    px, ex, tk, lx = [], [], [], []
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            phases, patches, tokens = row.get("rank_phase_s"), row.get("rank_patches"), row.get("rank_tokens")
            if not phases or patches is None or tokens is None:
                continue
            for r in range(len(patches)):
                enc = sum(phases.get(p, [0.0] * len(patches))[r] for p in _ENCODER)
                lang = sum(phases.get(p, [0.0] * len(patches))[r] for p in _LANGUAGE)
                if enc > 0:
                    px.append(float(patches[r]))
                    ex.append(enc)
                if lang > 0:
                    tk.append(float(tokens[r]))
                    lx.append(lang)
    return px, ex, tk, lx


def calibrate(run: str) -> Calibration:
    """The weights of ``run``'s measured phases; a one-line UserError naming the flag when it has none."""
    px, ex, tk, lx = read_points(run)
    enc, lang = fit(px, ex), fit(tk, lx)
    if enc is None or lang is None:
        missing = "encoder phases with patches" if enc is None else "language phases with tokens"
        raise UserError(f"{FLAG} {run}: its metrics.jsonl has no {missing} (a run of 2+ ranks logs them every "
                        f"--log-interval steps); run it longer or name another run")
    return Calibration(run=run, encoder=enc, language=lang)
