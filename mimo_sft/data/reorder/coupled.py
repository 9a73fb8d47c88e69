"""The swap refinement of the coupled colocated objective (pure numpy; see :mod:`.colocated_plan`).

A layout is a ``grid`` ``[G, per]`` of sample indices, as in :mod:`.balance`; groups ``[b*k, (b+1)*k)``
form block ``b`` (one slice of the coarse module). With ``f`` the fine module's per-sample term and
``c`` the coarse one's, group ``g``'s GPUs carry ``L(g) = F(g) + C(block(g))``.

:func:`refine` swaps one sample ``i`` of the heaviest GPU's block ``bh`` with one sample ``j`` of another
group while that lowers the heaviest load among the GPUs the swap touches (every group of ``bh`` and
of ``j``'s block when the blocks differ -- their ``C`` changes; the two groups otherwise, one of them
the heaviest). Those GPUs held the global maximum before, no other load changes, so each swap makes
the loads sorted in descending order lexicographically smaller: the loop cannot cycle, and a work
budget linear in the samples bounds it. The best swap is the one with the lowest new maximum (ties:
the lower flat index), computed for all candidates at once. Only elementwise IEEE operations, ``max``
and first-occurrence ``argmin`` / ``argmax`` decide, so every rank lays the same numbers out alike.
"""

from __future__ import annotations

import numpy as np

from mimo_sft.data.reorder.balance import Work, group_loads

#: Up to this many samples both starts (the layout as read, the decomposition) are refined.
SMALL_ITEMS = 64
#: Partner groups a round tries first (as :data:`.balance.REFINE_FIRST_PARTNERS`).
FIRST_PARTNERS = 16
_WORK_PER_ITEM = 1024
_WORK_MIN = 1 << 16

__all__ = ["SMALL_ITEMS", "Work", "heaviest", "loads", "refine", "work_budget"]


def work_budget(n: int) -> int:
    """Candidate swaps one refinement may examine: linear in the samples, as :mod:`.assign`'s."""
    return _WORK_PER_ITEM * n + _WORK_MIN


def _block_sums(per_group: np.ndarray, k: int) -> np.ndarray:
    """Per block, its ``k`` groups' values added in group order (a fixed order)."""
    blocks = per_group.reshape(-1, k)
    out = blocks[:, 0].copy()
    for j in range(1, k):
        out += blocks[:, j]
    return out


def loads(f: np.ndarray, c: np.ndarray, grid: np.ndarray, k: int) -> np.ndarray:
    """``L(g) = F(g) + C(block(g))`` of every group (rows summed in index order, comparable across grids)."""
    g = np.sort(grid, axis=1)
    return group_loads(f, g) + np.repeat(_block_sums(group_loads(c, g), k), k)


def heaviest(f: np.ndarray, c: np.ndarray, grid: np.ndarray, k: int) -> float:
    return float(loads(f, c, grid, k).max()) if grid.size else 0.0


def _excluding_self(F: np.ndarray, k: int) -> np.ndarray:
    """Per group, the largest ``F`` of the OTHER groups of its block (-inf when ``k == 1``)."""
    Fb = F.reshape(-1, k)
    if k == 1:
        return np.full(F.shape, -np.inf)
    first = Fb.argmax(axis=1)
    top1 = Fb.max(axis=1)
    masked = Fb.copy()
    masked[np.arange(Fb.shape[0]), first] = -np.inf
    top2 = masked.max(axis=1)
    out = np.repeat(top1, k).reshape(-1, k)
    out[np.arange(Fb.shape[0]), first] = top2
    return out.reshape(-1)


def lpt_within_blocks(f: np.ndarray, blocks: np.ndarray, k: int) -> np.ndarray:
    """Every block's samples dealt to its ``k`` groups by equal-count LPT, all blocks at once:
    ``blocks`` ``[B, k * per]`` -> grid ``[B * k, per]``. Heaviest first (ties: lower index) onto the
    block's lightest group with room (ties: lower group)."""
    B, m = blocks.shape
    per = m // k
    fb = f[blocks]
    order = np.argsort(-fb, axis=1, kind="stable")
    load = np.zeros((B, k))
    count = np.zeros((B, k), dtype=np.int64)
    out = np.empty((B, k, per), dtype=np.int64)
    rows = np.arange(B)
    for step in range(m):
        col = order[:, step]
        g = np.where(count < per, load, np.inf).argmin(axis=1)
        out[rows, g, count[rows, g]] = blocks[rows, col]
        load[rows, g] += fb[rows, col]
        count[rows, g] += 1
    return out.reshape(B * k, per)


def _scores(F, C, fg, cg, excl, blk, rows, cand, h, bh):
    """New maximum over the touched GPUs of every swap (sample of a group in ``rows`` x sample of a
    group in ``cand``): ``[k, per, len(cand), per]``; inf where the swap is not considered."""
    df = fg[cand][None, None, :, :] - fg[rows][:, :, None, None]  # F(g_i) changes by df, F(g_j) by -df
    dc = cg[cand][None, None, :, :] - cg[rows][:, :, None, None]  # C(bh) by dc, C(b_j) by -dc (blocks differ)
    Fi = F[rows][:, None, None, None]
    Fj = F[cand][None, None, :, None]
    cross = np.maximum(np.maximum(Fi + df, excl[rows][:, None, None, None]) + (C[bh] + dc),
                       np.maximum(Fj - df, excl[cand][None, None, :, None]) + (C[blk[cand]][None, None, :, None] - dc))
    inside = np.maximum(Fi + df, Fj - df) + C[bh]
    same_block = blk[cand] == bh
    score = np.where(same_block[None, None, :, None], inside, cross)
    # a sample cannot swap inside its own group; inside the block only swaps with the heaviest group
    # touch it (the others are the same swaps seen from the heaviest group's side, or miss it)
    bad = (rows[:, None] == cand[None, :]) | ((rows[:, None] != h) & same_block[None, :])
    return np.where(bad[:, None, :, None], np.inf, score)


def refine(f: np.ndarray, c: np.ndarray, grid: np.ndarray, k: int, work: Work, eps: float, stop_at: float) -> None:
    """Improve ``grid`` in place by single swaps (module docstring) until none helps, the heaviest load
    is down to ``stop_at`` (a lower bound) or ``work`` is spent. Partners: the heaviest block's groups
    and the :data:`FIRST_PARTNERS` lightest groups (ties: lower index); every group when none of
    those admits an improving swap."""
    G, per = grid.shape
    if G < 2 or per == 0:
        return
    blk = np.arange(G) // k
    everyone = np.arange(G)
    fg, cg = f[grid], c[grid]
    F = group_loads(f, grid)
    C = _block_sums(group_loads(c, grid), k)
    wide = G <= FIRST_PARTNERS + k
    while not work.spent:
        L = F + C[blk]
        h = int(L.argmax())
        top = float(L[h])
        if top <= stop_at:
            break
        bh = h // k
        rows = np.arange(bh * k, (bh + 1) * k)
        cand = everyone if wide else np.union1d(rows, np.argsort(L, kind="stable")[:FIRST_PARTNERS])
        score = _scores(F, C, fg, cg, _excluding_self(F, k), blk, rows, cand, h, bh)
        work.examined += score.size
        work.rounds += 1
        best = int(score.argmin())
        if not score.flat[best] < top - eps:
            if wide:
                break
            wide = True
            continue
        wide = G <= FIRST_PARTNERS + k
        a, s_, gc, t = np.unravel_index(best, score.shape)
        g = int(cand[gc])
        gi = int(rows[a])
        i, j = int(grid[gi, s_]), int(grid[g, t])
        grid[gi, s_], grid[g, t] = j, i
        d_f, d_c = float(fg[g, t] - fg[gi, s_]), float(cg[g, t] - cg[gi, s_])
        fg[gi, s_], fg[g, t] = f[j], f[i]
        cg[gi, s_], cg[g, t] = c[j], c[i]
        F[gi] += d_f
        F[g] -= d_f
        if blk[g] != bh:
            C[bh] += d_c
            C[blk[g]] -= d_c
        work.swaps += 1
