"""Balancing a colocated step: each GPU's vision slice plus its share of a language DP rank (pure).

On a colocated layout every GPU runs both modules: it encodes the images of its encoder DP slice,
then computes ``1 / language tp`` of its language DP rank's samples (the vision tower is not sharded:
on several vision tp ranks it is replicated, ``config.families``, and the replicas share the slice's images,
``train.tower_split``). So what gates a step is the heaviest GPU's *sum* of the two, not either module's
spread alone:

    load(GPU) = encoder weight * patches(its vision slice) / vision tp
              + language weight * real tokens(its language slice) / language tp

DP sizes divide one another, so the canonical grid has ``G = max(dp)`` groups: the module with the
larger DP size (the *fine* one) has one slice per group, the other (the *coarse* one) one slice per
*block* of ``k = G / min(dp)`` consecutive groups -- the layout ``data.colocated`` reads and megatron's
ColocatedBridgeCommunicator moves (fan-in: a language DP rank gathers the encoder outputs of its
``k`` vision slices, in group order; fan-out: the reverse). A group's load is then
``F(g) + C(block(g))`` with ``F`` the fine module's term and ``C`` the coarse one's; every GPU of a
group does the same work.

* Equal DP (``k = 1``): ``load(g)`` is a plain sum over the group's samples, so the existing planner
  (``assign.balanced_index_order``) balances the combined per-sample cost. It also balances the fine
  module's groups alone when the coarse term is zero (language weight 0 on fan-in) or the same on
  every GPU (one coarse slice), and the coarse slices alone when the fine term is zero.
* Fan-in / fan-out: the coupled objective ``max_g F(g) + C(block(g))``. Up to
  :data:`.coupled.SMALL_ITEMS` samples, three starts -- the layout as read; the blocks balanced on
  ``c + f / k`` (a block's best heaviest GPU is about ``C + F / k``), then each block's groups on
  ``f``; the groups balanced on ``f``, then dealt to blocks balancing ``c`` -- each refined by swaps
  between one sample of the heaviest GPU's block and another sample while they lower the heaviest
  load among the GPUs they touch (:func:`.coupled.refine`), down to the mean GPU (a lower bound).
  ``tests/test_colocated_plan.py`` measures it against brute force. Above that, the last start
  with balanced differencing only, then rounds of many such swaps at once
  (:func:`.coupled.pair_swaps`) and single swaps, until the heaviest GPU is within
  :data:`NEAR_MEAN` of the mean GPU: 3-4x a heap LPT of the samples at 256 groups x 8 samples, where
  refining every start to the end took 37-51x (``scripts/bench_reorder.py``, table f). The layout
  as read is kept when nothing beats it (or, above that size, when it is already that close).

Same determinism rules as :mod:`.balance`: every rank computes the same order from the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from mimo_sft.data.reorder import balance, coupled
from mimo_sft.data.reorder.assign import balanced_groups, balanced_index_order, check_grid
from mimo_sft.data.reorder.load_bounds import load_spread, module_load_figures

VISION, LANGUAGE = "vision", "language"


@dataclass(frozen=True)
class ColocatedGrid:
    """What the planner needs of a colocated layout: the DP sizes and the language TP size (tp x cp: the GPUs
    that share one language slice's work)."""

    vision_dp: int
    language_dp: int
    language_tp: int = 1
    #: the tower's replicas that share one vision slice's images (``train.tower_split``)
    vision_tp: int = 1

    def __post_init__(self):
        lo, hi = sorted((self.vision_dp, self.language_dp))
        if lo < 1 or hi % lo or self.language_tp < 1 or self.vision_tp < 1:
            raise ValueError(f"vision dp {self.vision_dp} and language dp {self.language_dp} must divide one "
                             f"another (language tp {self.language_tp})")

    @classmethod
    def from_layout(cls, layout) -> "ColocatedGrid":
        (enc,) = layout.encoders
        # a language DP slice's work is shared by its tp x cp GPUs (context parallelism splits its positions)
        return cls(vision_dp=enc.dp, language_dp=layout.language.dp,
                   language_tp=layout.language.tp * layout.language.cp, vision_tp=enc.tp)

    @property
    def n_groups(self) -> int:
        return max(self.vision_dp, self.language_dp)

    @property
    def block(self) -> int:
        """Groups per slice of the coarse module (1: equal DP)."""
        return self.n_groups // min(self.vision_dp, self.language_dp)

    @property
    def fine(self) -> str:
        """The module with one slice per canonical group (vision on ties)."""
        return VISION if self.vision_dp >= self.language_dp else LANGUAGE


def sample_terms(patches: Sequence[float], tokens: Sequence[float], grid: ColocatedGrid, *,
                 encoder_cost_weight: float, language_cost_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, what it adds to a GPU of its vision slice and to a GPU of its language slice."""
    vision = (encoder_cost_weight / grid.vision_tp) * np.asarray(patches, dtype=np.float64).reshape(-1)
    language = (language_cost_weight / grid.language_tp) * np.asarray(tokens, dtype=np.float64).reshape(-1)
    if vision.shape != language.shape:
        raise ValueError(f"{vision.size} patch counts but {language.size} token counts")
    return vision, language


def group_loads(vision: Sequence[float], language: Sequence[float], grid: ColocatedGrid,
                order: Sequence[int] | None = None) -> list[float]:
    """Load of each canonical group's GPUs when the micro-batch is laid out as ``order`` (None: as read):
    its vision slice's term plus its language slice's term."""
    v = np.asarray(vision, dtype=np.float64)
    lang = np.asarray(language, dtype=np.float64)
    n = v.size
    order = np.arange(n) if order is None else np.asarray(order, dtype=np.int64)
    if sorted(order.tolist()) != list(range(n)):
        raise ValueError("order must be a permutation of the sample indices")
    per = check_grid(n, grid.n_groups)
    g = np.arange(grid.n_groups)
    out = []
    for terms, dp in ((v, grid.vision_dp), (lang, grid.language_dp)):
        span = per * (grid.n_groups // dp)  # samples of one slice of this module
        slices = np.array([math.fsum(terms[order[r * span:(r + 1) * span]].tolist()) for r in range(dp)])
        out.append(slices[g // (grid.n_groups // dp)])
    return (out[0] + out[1]).tolist()


#: Above :data:`.coupled.SMALL_ITEMS` samples the plan stops once the heaviest GPU is within this
#: fraction of the mean GPU (a lower bound: no layout is more than that much lighter), issue 46's
#: quality target. Stopping at 0.05 % instead took 10-25x a heap LPT at 256 groups x 8, not 3-4x.
NEAR_MEAN = 1e-3


def colocated_order(vision: Sequence[float], language: Sequence[float], grid: ColocatedGrid) -> list[int]:
    """The balanced canonical order of one micro-batch (group by group, ``n / G`` samples each)."""
    v = np.asarray(vision, dtype=np.float64).reshape(-1)
    lang = np.asarray(language, dtype=np.float64).reshape(-1)
    n, G, k = v.size, grid.n_groups, grid.block
    per = check_grid(n, G)
    if k == 1:
        return balanced_index_order((v + lang).tolist(), G)
    if per == 0:
        return []
    f, c = (v, lang) if grid.fine == VISION else (lang, v)
    B = G // k
    ident = np.arange(n, dtype=np.int64).reshape(G, per)
    as_read = coupled.heaviest(f, c, ident, k)
    if B == 1 or not c.any() or not f.any():  # one module's slices alone decide
        costs, groups = (f, G) if B == 1 or not c.any() else (c, B)
        best = np.array(balanced_index_order(costs.tolist(), groups), dtype=np.int64).reshape(G, per)
        return _canonical(best if coupled.heaviest(f, c, best, k) < as_read else ident, k)
    eps = 1e-12 * max(1.0, float(np.abs(f).max()), float(np.abs(c).max()))
    mean = math.fsum(f.tolist()) / G + math.fsum(c.tolist()) / B  # the mean GPU: nothing can beat it
    stop_at = mean + eps if n <= coupled.SMALL_ITEMS else mean * (1 + NEAR_MEAN)
    if as_read <= stop_at:
        return list(range(n))
    if n <= coupled.SMALL_ITEMS:  # every start, the layout as read too, refined to the end
        starts = [ident.copy(), _decomposed_start(f, c, G, k, per), _combined_start(f, c, G, k, per)]
        for grid_ in starts:
            coupled.refine(f, c, grid_, k, coupled.Work(budget=coupled.work_budget(n)), eps, stop_at)
    else:  # one cheap start, rounds of many swaps, then single swaps
        starts = [_combined_start(f, c, G, k, per, search=False)]
        coupled.pair_swaps(f, c, starts[0], k, coupled.Work(budget=coupled.work_budget(n)), eps, stop_at)
        coupled.refine(f, c, starts[0], k, coupled.Work(budget=coupled.work_budget(n)), eps, stop_at)
    tops = [coupled.heaviest(f, c, s, k) for s in starts]
    best = starts[tops.index(min(tops))]
    if as_read <= min(tops):
        best = ident  # nothing beats the layout as read: nothing moves
    return _canonical(best, k)


def _decomposed_start(f: np.ndarray, c: np.ndarray, G: int, k: int, per: int) -> np.ndarray:
    """Blocks balanced on ``c + f / k``, then each block's ``k`` groups on ``f``: ``[G, per]``."""
    blocks = np.array(balanced_groups((c + f / k).tolist(), G // k), dtype=np.int64)  # [B, k * per]
    return np.array([[items[j] for j in grp] for items in blocks.tolist()
                     for grp in balanced_groups(f[items].tolist(), k)], dtype=np.int64).reshape(G, per)


def _combined_start(f: np.ndarray, c: np.ndarray, G: int, k: int, per: int, *, search: bool = True) -> np.ndarray:
    """Groups balanced on ``f``, then dealt ``k`` to a block balancing their ``c``: the better start
    where the fine term is the lumpier (with language weight 0 on fan-in, the whole story).
    ``search=False``: balanced differencing for both."""
    if not search:
        groups = balance.differencing_start(f, G)
        blocks = balance.differencing_start(balance.group_loads(c, groups), G // k)
        return np.ascontiguousarray(groups[blocks.reshape(-1)])
    groups = balanced_groups(f.tolist(), G)
    blocks = balanced_groups([math.fsum(c[g].tolist()) for g in groups], G // k)
    return np.array([groups[i] for b in blocks for i in b], dtype=np.int64).reshape(G, per)


def _canonical(grid: np.ndarray, k: int) -> list[int]:
    """The order of a grid: samples sorted inside each group, groups by their first sample inside each
    block (they share the coarse slice), blocks by their first sample -- close to the identity."""
    G, per = grid.shape
    if per == 0:
        return []
    blocks = np.sort(grid, axis=1).reshape(G // k, k, per)
    blocks = np.take_along_axis(blocks, np.argsort(blocks[:, :, 0], axis=1, kind="stable")[:, :, None], axis=1)
    order = blocks[np.argsort(blocks[:, 0, 0], kind="stable")].reshape(-1)
    if not np.array_equal(np.sort(order), np.arange(G * per)):
        raise AssertionError(f"colocated order is not a permutation: {order.tolist()}")
    return order.tolist()


def colocated_plan_info(tokens: Sequence[float], patches: Sequence[float], *, grid: ColocatedGrid,
                        encoder_cost_weight: float, language_cost_weight: float,
                        stats_dp_sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One micro-batch's plan and statistics, with the keys ``window_plan.window_plan_info`` gives.

    ``tokens`` / ``patches``: real tokens and image patches per sample of the GLOBAL micro-batch, in
    position order (what index mode gathers on a colocated layout). ``cost_*``: per canonical group,
    the load of its GPUs (:func:`group_loads`) before and after; ``{name}_load_*``: the patches over a
    module of DP size ``d`` for each ``name: d`` of ``stats_dp_sizes`` (``vision``: what metrics log).
    """
    vision, language = sample_terms(patches, tokens, grid, encoder_cost_weight=encoder_cost_weight,
                                    language_cost_weight=language_cost_weight)
    order = colocated_order(vision, language, grid)
    before, after = group_loads(vision, language, grid), group_loads(vision, language, grid, order)
    sb, sa = load_spread(before), load_spread(after)
    info: dict[str, Any] = {"order": order, "global_costs": (vision + language).tolist(),
                            "cost_before": before, "cost_after": after,
                            "cost_max_over_mean_before": sb["max_over_mean"],
                            "cost_max_over_mean_after": sa["max_over_mean"]}
    loads = [float(p) for p in patches]
    info.update(module_load_figures(loads, order, grid.n_groups, stats_dp_sizes))
    return info
