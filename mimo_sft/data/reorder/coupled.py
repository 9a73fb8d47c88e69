"""The swap refinements of the coupled colocated objective (pure numpy; see :mod:`.colocated_plan`).

A layout is a ``grid`` ``[G, per]`` of sample indices, as in :mod:`.balance`; groups ``[b*k, (b+1)*k)``
form block ``b`` (one slice of the coarse module). With ``f`` the fine module's per-sample term and
``c`` the coarse one's, group ``g``'s GPUs carry ``L(g) = F(g) + C(block(g))``.

:func:`refine` swaps one sample ``i`` of the heaviest GPU's block ``bh`` with one sample ``j`` of another
group while that lowers the heaviest load among the GPUs the swap touches (every group of ``bh`` and
of ``j``'s block when the blocks differ -- their ``C`` changes; the two groups otherwise, one of them
the heaviest). Those GPUs held the global maximum before, no other load changes, so each swap makes
the loads sorted in descending order lexicographically smaller: the loop cannot cycle, and a work
budget linear in the samples bounds it. The best swap is the one with the lowest new maximum (ties:
the lower flat index), computed for all candidates at once. One swap a round: the small micro-batches'
search, and the last steps of the large ones'.

:func:`pair_swaps` makes many such swaps a round, one per block above a target, each with partner
blocks of its own (the large micro-batches' refinement, issue 46): the same descent, about ten
rounds from a start a few percent above the mean GPU to 0.1 % at 256 groups.

Only elementwise IEEE operations, ``max``, stable sorts and first-occurrence ``argmin`` / ``argmax``
decide, so every rank lays the same numbers out alike.
"""

from __future__ import annotations

import numpy as np

from mimo_sft.data.reorder.balance import PAIR_BUSY, PAIR_ROUNDS_MAX, Work, _shuffle, _swap_scores, group_loads

#: Up to this many samples every start (the layout as read too) is refined to the end by :func:`refine`.
SMALL_ITEMS = 64
#: Partner groups a round tries first (as :data:`.balance.REFINE_FIRST_PARTNERS`).
FIRST_PARTNERS = 16
_WORK_PER_ITEM = 1024
_WORK_MIN = 1 << 16
#: Rounds in a row after the first shuffle that may leave the heaviest GPU where it was.
PAIR_PATIENCE = 4

__all__ = ["SMALL_ITEMS", "Work", "heaviest", "loads", "pair_swaps", "refine", "work_budget"]


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


def _within_blocks(f: np.ndarray, c: np.ndarray, gb: np.ndarray, fb: np.ndarray, cb: np.ndarray, F: np.ndarray,
                   blocks: np.ndarray, work: Work, eps: float) -> None:
    """In each of ``blocks`` at once, the best swap between its heaviest and its lightest group (ties:
    the lower group, then the lower slots) when it lowers the heavier of the two: ``C`` does not move,
    the block's spread of ``F`` shrinks. ``gb`` / ``fb`` / ``cb`` ``[B, k * per]`` and ``F`` ``[B, k]``
    are updated in place."""
    k = F.shape[1]
    per = gb.shape[1] // k
    if k < 2 or not blocks.size:
        return
    hi, lo = F[blocks].argmax(axis=1), F[blocks].argmin(axis=1)
    xs = (hi * per)[:, None] + np.arange(per)  # block slots of the heaviest / lightest group
    ys = (lo * per)[:, None] + np.arange(per)
    r = blocks[:, None]
    x = _swap_scores(fb[r, xs], fb[r, ys], F[blocks, hi], F[blocks, lo]).reshape(blocks.size, per * per)
    best = x.argmin(axis=1)
    ok = x[np.arange(blocks.size), best] < -eps
    work.examined += x.size
    if not ok.any():
        return
    b = blocks[ok]
    a, t = np.divmod(best[ok], per)
    sx, sy = xs[ok, a], ys[ok, t]
    i, j = gb[b, sx], gb[b, sy]
    gb[b, sx], gb[b, sy] = j, i
    d = fb[b, sx] - fb[b, sy]
    fb[b, sx], fb[b, sy] = f[j], f[i]
    cb[b, sx], cb[b, sy] = c[j], c[i]
    F[b, hi[ok]] -= d
    F[b, lo[ok]] += d


def pair_swaps(f: np.ndarray, c: np.ndarray, grid: np.ndarray, k: int, work: Work, eps: float,
               stop_at: float) -> None:
    """Rounds of many swaps at once (the large micro-batches' refinement); ``grid`` improves in place.

    A block's load is its heaviest GPU's. Each round:

    1. every block swaps one sample between its heaviest and its lightest group when that lowers
       the heavier (:func:`_within_blocks`: ``C`` stays, the block's spread of ``F`` shrinks);
    2. the ``h`` heaviest blocks, those above ``stop_at`` but at most half of them, get ``r = (B //
       2) // h`` partners each among the lightest blocks (one each at first, more as fewer are left
       above; after a round that did not lower the heaviest, those blocks in a fixed shuffled order
       rotated every round, as in :func:`.balance.pair_swaps`), and each takes its best swap with one
       of its partners: the lowest new maximum over the GPUs of both blocks, when below its own.

    A swap's new loads are ``(load less the sample given) + the sample got`` for the two groups and
    ``(top of the other groups less the coarse term given) + the one got`` for their blocks' other
    GPUs: four outer sums over the two blocks' samples. Each accepted swap lowers the maximum of the
    GPUs it changes and blocks take part in one swap each, so the loads sorted in descending order
    fall lexicographically, as in :func:`refine`. Stops when the heaviest GPU is down to ``stop_at``,
    after :data:`.balance.PAIR_ROUNDS_MAX` rounds, when ``work`` is spent, or when
    :data:`PAIR_PATIENCE` rounds in a row after the first shuffle leave the heaviest where it was.
    """
    G, per = grid.shape
    B = G // k
    m = B // 2
    if m < 1 or per == 0:
        return
    kp = k * per
    gb = np.array(grid, dtype=np.int64).reshape(B, kp)
    fb, cb = f[gb], c[gb]
    F = group_loads(f, grid).reshape(B, k)
    C = _block_sums(group_loads(c, grid), k)
    everyone = np.arange(B)
    # allocated once: fresh arrays this size would be mapped and faulted in again every round
    buffers = (np.empty(m * kp * kp), np.empty(m * kp * kp))
    shuffled, stale, rounds = 0, 0, 0
    while rounds < PAIR_ROUNDS_MAX and stale < PAIR_PATIENCE and not work.spent:
        rounds += 1
        M = F.max(axis=1) + C
        before = float(M.max())
        if before <= stop_at:
            break
        _within_blocks(f, c, gb, fb, cb, F, everyone, work, eps)
        M = F.max(axis=1) + C
        by_load = np.argsort(M, kind="stable")
        h = min(m, max(1, int(np.count_nonzero(M > stop_at))))
        r = m // h
        heavy, light = by_load[: -h - 1: -1], by_load[:h * r]
        if shuffled:
            light = light[_shuffle(h * r).take(np.arange(h * r) + shuffled, mode="wrap")]
        light = light.reshape(r, h).T  # [h, r]: each heavy block's partners
        score = _pair_scores(fb, cb, F, C, heavy, light, k, per, buffers)
        best = score.argmin(axis=1)
        ok = score[np.arange(h), best] < M[heavy] - eps
        work.examined += score.size
        work.pair_rounds += 1
        if ok.any():
            _apply_pair_swaps(f, c, gb, fb, cb, F, C, heavy[ok], light[np.flatnonzero(ok)], best[ok], per)
            work.swaps += int(ok.sum())
        improved = float((F.max(axis=1) + C).max()) < before - eps
        busy = int(ok.sum()) * PAIR_BUSY >= h
        stale = 0 if improved or (shuffled and busy) else stale + (1 if shuffled else 0)
        shuffled += 1 if shuffled or not improved else 0
    grid[:] = gb.reshape(G, per)


def _pair_scores(fb, cb, F, C, heavy, light, k: int, per: int, buffers) -> np.ndarray:
    """``[h, r * kp * kp]``: for each heavy block, partner, heavy slot and partner slot, the highest load among
    the GPUs of both blocks after swapping the two slots' samples (:func:`pair_swaps`)."""
    B, kp = fb.shape
    h, r = light.shape
    sb = fb + cb
    P = np.repeat(F, per, axis=1) + C[:, None] - sb  # per slot: its GPU's load less its sample
    Q = np.repeat(_excluding_self(F.reshape(-1), k).reshape(B, k), per, axis=1) + C[:, None] - cb
    shape = (h, r, kp, kp)  # heavy block, partner, heavy slot, partner slot
    score, tmp = (b[:h * r * kp * kp].reshape(shape) for b in buffers)
    np.add(P[heavy][:, None, :, None], sb[light][:, :, None, :], out=score)
    np.maximum(score, np.add(Q[heavy][:, None, :, None], cb[light][:, :, None, :], out=tmp), out=score)
    np.maximum(score, np.add(P[light][:, :, None, :], sb[heavy][:, None, :, None], out=tmp), out=score)
    np.maximum(score, np.add(Q[light][:, :, None, :], cb[heavy][:, None, :, None], out=tmp), out=score)
    return score.reshape(h, r * kp * kp)


def _apply_pair_swaps(f, c, gb, fb, cb, F, C, hs, partners, best, per: int) -> None:
    """Swap each heavy block ``hs``'s chosen slot with its chosen partner's (``best``: flat index into the
    scores), keeping the per-slot terms and the loads in step."""
    kp = fb.shape[1]
    q, rest = np.divmod(best, kp * kp)
    x, y = np.divmod(rest, kp)
    ls = partners[np.arange(len(hs)), q]
    i, j = gb[hs, x], gb[ls, y]
    gb[hs, x], gb[ls, y] = j, i
    d_f, d_c = fb[ls, y] - fb[hs, x], cb[ls, y] - cb[hs, x]
    fb[hs, x], fb[ls, y] = f[j], f[i]
    cb[hs, x], cb[ls, y] = c[j], c[i]
    F[hs, x // per] += d_f
    F[ls, y // per] -= d_f
    C[hs] += d_c
    C[ls] -= d_c
