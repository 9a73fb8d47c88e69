"""Encoder-only balancing's plan: which tower encodes each image of a micro-batch (pure).

Sample placement (``colocated_plan``) moves whole samples, so it cannot split one sample's images: a row of
five pages stays on one GPU. ``--encoder-balance`` moves single images instead, to another tower of the same
vision DP group, and sends the embeddings (and their gradients) back to the GPU whose language slice holds the
sample (``train.encoder_balance``; measured in ``scripts/bench_encoder_balance.py``). Every rank of the group
gathers every rank's image sizes and computes this plan itself, so they agree without a broadcast.

A clip is split at its temporal-patch boundaries (:func:`temporal_units`): each temporal patch is a unit of its
own, planned like an image, so one long clip is encoded by several towers (under language context parallelism,
by the GPUs of its cp group and beyond) rather than by the one whose slice holds it. That is exact: Qwen-VL
towers attend within one temporal patch (their ``cu_seqlens`` are per frame), merge 2x2 patches within it, and
build each one's positions from its ``h, w`` alone, so a clip's output is its units' outputs back to back.

The plan: units heaviest first (ties: lower rank, then lower index) onto the tower with the least load so far;
among equally loaded towers the image's own comes first, then the lowest rank (an image stays home whenever
that is as good). If that leaves the heaviest tower no lighter than the layout as read, nothing moves. A cost
is an image's patches, as the reorder planner counts them. Only comparisons of sums of the same floats decide.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from mimo_sft.data.reorder.load_bounds import load_spread


def temporal_units(grid: torch.Tensor, temporal: int) -> torch.Tensor:
    """A rank's carried pixel grid ``[n, 3]`` (host; a clip's first side is ``T * temporal`` frames,
    ``model.pixels``) -> the grid of its units, in order: an image is one unit, a clip of ``T`` temporal patches
    ``T`` units of pixel grid ``(temporal, h, w)``. The units' pixel rows and output rows, back to back, are the
    items' (a clip's rows are temporal-patch major)."""
    if grid.shape[0] == 0:
        return grid
    t = grid[:, 0]
    repeats = torch.where(t > 1, t // temporal, torch.ones_like(t))
    units = grid.repeat_interleave(repeats, dim=0)
    units[:, 0] = torch.where(units[:, 0] > 1, torch.full_like(units[:, 0], temporal), units[:, 0])
    return units


def tower_loads(costs: Sequence[Sequence[float]], dest: Sequence[Sequence[int]] | None = None) -> list[float]:
    """Each tower's load: the costs of the images it encodes (``dest`` None: every image at home)."""
    loads = [[] for _ in costs]
    for r, cs in enumerate(costs):
        for i, c in enumerate(cs):
            loads[r if dest is None else dest[r][i]].append(float(c))
    return [math.fsum(x) for x in loads]


def encoder_destinations(costs: Sequence[Sequence[float]]) -> list[list[int]]:
    """For each rank's images, in order, the rank whose tower encodes it (see the module docstring)."""
    ranks = len(costs)
    home = [[r] * len(cs) for r, cs in enumerate(costs)]
    items = sorted(((float(c), r, i) for r, cs in enumerate(costs) for i, c in enumerate(cs)),
                   key=lambda t: (-t[0], t[1], t[2]))
    if ranks < 2 or not items:
        return home
    loads = np.zeros(ranks, dtype=np.float64)
    dest = [list(d) for d in home]
    for c, r, i in items:
        least = loads.min()
        q = r if loads[r] == least else int(np.flatnonzero(loads == least)[0])
        dest[r][i] = q
        loads[q] += c
    if max(tower_loads(costs, dest)) >= max(tower_loads(costs)):
        return home
    return dest


def spread(loads: Sequence[float]) -> float | None:
    """Heaviest over mean (``load_bounds.load_spread``), None where there is no load (a text-only micro-batch)."""
    return load_spread(loads)["max_over_mean"] if loads and max(loads) > 0 else None
