"""Vectorised kernels of the equal-count balancing that :mod:`assign` runs (pure numpy).

Why a module of its own: :mod:`assign` is the balancing's API (LPT, the search, orders)
and reads as Python; these are the numpy inner loops that keep a plan of thousands of samples in
the millisecond range (issue 16), and their determinism argument is easier to check in one place:

* only elementwise IEEE operations (``+``, ``-``, ``abs``, comparisons), ``max`` / ``min``, stable
  sorts and first-occurrence ``argmin`` / ``argmax`` decide anything: no sums whose order could
  depend on the SIMD width of the machine, no RNG stream, no hash-ordered containers, no threads.
  Group loads are summed column by column, in slot order. Equal fp64 costs therefore give the
  same layout on every rank;
* every tie is broken by an index (item, group, slot, or a rank in a stable sort by load).

A layout is a ``grid``: an int64 array ``[n_groups, per]`` of item indices, one row per group.
Functions that improve a grid mutate it in place and count the work they did in a :class:`Work`
(candidate swaps examined), which the caller caps linearly in the number of items.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

#: Candidate partner groups of the refinement: the ``REFINE_FIRST_PARTNERS`` lightest first; when
#: none of them admits an improving swap for the heaviest group, the ``REFINE_MAX_PARTNERS``
#: lightest. Up to ``REFINE_FIRST_PARTNERS`` groups the search is exhaustive from the start (the
#: exact refinement of the small cases). The second cap keeps one round ``O(per**2)``, not
#: ``O(n * per)``: without it the rounds that widen, about a tenth of ``O(groups)`` rounds, made
#: the work grow as ``n**2 / per``; 128 gave the same quality as no cap up to 512 groups.
REFINE_FIRST_PARTNERS = 16
REFINE_MAX_PARTNERS = 128
#: Cap on the batched heavy/light pairing rounds of one :func:`pair_swaps`; how many shuffled
#: rounds in a row may leave the heaviest group where it was before the pairing gives up, unless
#: at least one pair in ``PAIR_BUSY`` still swapped in them.
PAIR_ROUNDS_MAX = 64
PAIR_PATIENCE = 2
PAIR_BUSY = 8
#: :func:`improve` alternates pair swaps and refinement at most this many times.
IMPROVE_CYCLES = 3


@dataclass
class Work:
    """Candidate swaps examined (``examined``), against ``budget``; rounds of each phase."""

    budget: int
    examined: int = 0
    pair_rounds: int = 0
    rounds: int = 0
    swaps: int = 0

    @property
    def spent(self) -> bool:
        return self.examined >= self.budget


def group_loads(c: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Per-group sum of ``c`` over the grid's rows, added column by column (a fixed order)."""
    loads = c[grid[:, 0]].copy() if grid.shape[1] else np.zeros(grid.shape[0])
    for k in range(1, grid.shape[1]):
        loads += c[grid[:, k]]
    return loads


def heaviest(c: np.ndarray, grid: np.ndarray) -> float:
    """Heaviest group of a grid, its rows summed in index order (comparable across candidates)."""
    return float(group_loads(c, np.sort(grid, axis=1)).max()) if grid.size else 0.0


def differencing_start(c: np.ndarray, n_groups: int) -> np.ndarray:
    """Balanced largest differencing (Karmarkar-Karp for equal counts): ``[n_groups, per]``.

    Items sorted heaviest first (ties: lower index) are cut into ``per`` blocks of ``n_groups``;
    each block is a partial layout of one item per group. The two partial layouts with the widest
    spread (max - min load; ties: older first) are merged by putting the heaviest group of one with
    the lightest of the other, until one layout is left. ``per - 1`` merges of ``O(G log G)`` each.
    """
    per = len(c) // n_groups
    order = np.argsort(-c, kind="stable")
    parts = []  # (spread, age, rows, loads): the widest spread first, then the older
    for k in range(per):
        block = order[k * n_groups:(k + 1) * n_groups]
        loads = c[block]  # descending
        parts.append((float(loads[0] - loads[-1]), k, block.reshape(n_groups, 1), loads))
    age = per
    while len(parts) > 1:
        parts.sort(key=lambda p: (-p[0], p[1]))
        (_, _, ra, la), (_, _, rb, lb) = parts[0], parts[1]
        oa = np.argsort(-la, kind="stable")
        ob = np.argsort(lb, kind="stable")
        loads = la[oa] + lb[ob]
        parts = parts[2:] + [(float(loads.max() - loads.min()), age, np.concatenate([ra[oa], rb[ob]], axis=1), loads)]
        age += 1
    return np.ascontiguousarray(parts[0][2], dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _shuffle(m: int) -> np.ndarray:
    """A fixed pseudo-random permutation of ``range(m)``: splitmix64 of the index in wrapping
    uint64 arithmetic and a stable sort, so it is the same on every machine and numpy version (no
    RNG stream involved)."""
    x = np.arange(m, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    out = np.argsort(x, kind="stable")
    out.flags.writeable = False  # cached: shared by every call
    return out


def _swap_scores(ch: np.ndarray, cl: np.ndarray, lh: np.ndarray, ll: np.ndarray) -> np.ndarray:
    """``[pairs, per, per]``: new pair maximum minus ``lh`` for every swap; the swap helps iff < -eps.

    Swapping item ``a`` of a heavier group (load ``lh``) with item ``b`` of a lighter one (``ll``)
    moves ``d = ch[a] - cl[b]``; with ``half = (lh - ll) / 2`` the new pair maximum is
    ``max(lh - d, ll + d) = lh - half + |d - half|``, and the swap helps iff
    ``eps < d < lh - ll - eps``, i.e. ``|d - half| - half < -eps``. Three passes over the cube.
    """
    half = (lh - ll) * 0.5
    x = np.abs(ch[:, :, None] - (cl + half[:, None])[:, None, :])
    x -= half[:, None, None]
    return x


def pair_swaps(c: np.ndarray, grid: np.ndarray, work: Work, eps: float) -> None:
    """Rounds of simultaneous swaps between the heavier half of the groups and the lighter half.

    The k-th heaviest group is paired with the k-th lightest while that lowers the heaviest group;
    then with the lighter half in a fixed shuffled order, rotated by one every round
    (:func:`_shuffle`), which reaches partners of middling load whose items fit, until
    :data:`PAIR_PATIENCE` such rounds in a row leave the heaviest group where it was. Each pair
    takes its best single swap (:func:`_swap_scores`; ties: lower slot in the heavy group, then in
    the light one) when that helps; pairs are disjoint, so all of them move at once and no group
    ever ends heavier than the heaviest was. At most :data:`PAIR_ROUNDS_MAX` rounds of
    ``G/2 * per**2`` candidate swaps. Does nothing with at most :data:`REFINE_FIRST_PARTNERS`
    groups, where the refinement searches every partner anyway.
    """
    n_groups, per = grid.shape
    m = n_groups // 2
    if n_groups <= REFINE_FIRST_PARTNERS or per == 0:
        return
    rows = np.arange(m)
    shuffle = _shuffle(m)
    shuffled, stale, rounds = 0, 0, 0
    cg = c[grid]
    loads = group_loads(c, grid)
    while rounds < PAIR_ROUNDS_MAX and stale < PAIR_PATIENCE and not work.spent:
        rounds += 1
        by_load = np.argsort(loads, kind="stable")
        heavy, light = by_load[: -m - 1 : -1], by_load[:m]
        if shuffled:
            light = light[shuffle.take(rows + shuffled, mode="wrap")]
        lh = loads[heavy]
        flat = _swap_scores(cg[heavy], cg[light], lh, loads[light]).reshape(m, per * per)
        best = flat.argmin(axis=1)
        ok = flat[rows, best] < -eps
        work.examined += flat.size
        work.pair_rounds += 1
        top = lh[0]
        if ok.any():
            a, b = np.divmod(best[ok], per)
            hs, ls = heavy[ok], light[ok]
            moved, back = grid[hs, a], grid[ls, b]
            grid[hs, a], grid[ls, b] = back, moved
            c_moved, c_back = cg[hs, a], cg[ls, b]
            cg[hs, a], cg[ls, b] = c_back, c_moved
            delta = c_moved - c_back
            loads[hs] -= delta
            loads[ls] += delta
        improved = loads.max() < top - eps
        busy = int(ok.sum()) * PAIR_BUSY >= m
        stale = 0 if improved or (shuffled and busy) else stale + (1 if shuffled else 0)
        shuffled += 1 if shuffled or not improved else 0


def improve(c: np.ndarray, grid: np.ndarray, work: Work, eps: float, stop_at: float) -> None:
    """:func:`pair_swaps`, then :func:`refine_swaps`, again while that lowers the heaviest group
    (at most :data:`IMPROVE_CYCLES` times): once the refinement is stuck, a new pairing round
    reshuffles the middle groups and often opens a swap for the heaviest one again."""
    best = math.inf
    for _ in range(IMPROVE_CYCLES):
        pair_swaps(c, grid, work, eps)
        refine_swaps(c, grid, work, eps, stop_at)
        if grid.shape[0] <= REFINE_FIRST_PARTNERS:
            return  # no pairing there: a second cycle would find nothing new
        top = float(group_loads(c, grid).max())
        if top <= stop_at or not top < best - eps or work.spent:
            return
        best = top


def refine_swaps(c: np.ndarray, grid: np.ndarray, work: Work, eps: float, stop_at: float) -> None:
    """Swap one item of the heaviest group with one lighter item of another group while that helps.

    Each accepted swap moves ``d > 0`` from the heaviest group ``h`` (ties: lower index) to a
    group ``g`` with ``L_g + d < L_h``, so ``sum(L**2)`` strictly drops. The swap taken minimises
    ``(max(L_h - d, L_g + d), g, slot in h, slot in g)`` (:func:`_swap_scores`) over the candidate
    partners: the :data:`REFINE_FIRST_PARTNERS` lightest groups (ties: lower index), or the
    :data:`REFINE_MAX_PARTNERS` lightest when none of those admits an improving swap. With no
    more groups than that the search is exhaustive. Stops when the heaviest group has no improving
    swap, when it is down to ``stop_at`` (a lower bound: nothing can beat it), or when the work
    budget is spent. A round examines at most ``REFINE_MAX_PARTNERS * per**2`` swaps.
    """
    n_groups, per = grid.shape
    if n_groups < 2 or per == 0:
        return
    cg = c[grid]
    loads = group_loads(c, grid)
    rows, cv = grid.tolist(), c.tolist()
    first = min(REFINE_FIRST_PARTNERS, n_groups)
    most = min(REFINE_MAX_PARTNERS, n_groups)
    k = first
    everyone = np.arange(n_groups)
    while not work.spent:
        h = int(loads.argmax())  # ties: the lower index
        lh = float(loads[h])
        if lh <= stop_at:
            break
        partners = everyone if k >= n_groups else np.sort(np.argsort(loads, kind="stable")[:k])
        x = _swap_scores(cg[h][None, :], cg[partners], lh, loads[partners])  # new max - L_h
        f = int(x.argmin())
        work.examined += x.size
        work.rounds += 1
        if not x.flat[f] < -eps:
            if k >= most:
                break
            k = most
            continue
        gi, rest = divmod(f, per * per)
        a, b = divmod(rest, per)
        g = int(partners[gi])
        i, j = rows[h][a], rows[g][b]
        rows[h][a], rows[g][b] = j, i
        cg[h, a], cg[g, b] = cv[j], cv[i]
        moved = cv[i] - cv[j]
        loads[h] -= moved
        loads[g] += moved
        work.swaps += 1
        k = first
    grid[:] = rows
