"""How closely a dataset mixture's draws follow its weights, per global batch and at every prefix: the
interleave checkpoints were trained with before (``shuffled`` chunks of 1024) against the current one
(``deficit``: Tijdeman's earliest-deadline rule, ``data.mixture.deficit_pattern``).

For each weight vector and global batch size B it walks the first N positions and prints
- the worst prefix error: max over prefixes p and sources s of |draws of s in [0, p) - share_s * p| (samples);
- the per-batch spread: over the global batches [jB, (j+1)B), the largest |draws of s - share_s * B| (samples),
  and the mean of that per-batch maximum;
- the first 96 samples' shares (the example of issue 42: 0.75/0.25 drew 0.66/0.34).

    .venv/bin/python scripts/bench_mixture_shares.py [--positions 20000]
"""

from __future__ import annotations

import argparse

import numpy as np

from mimo_sft.data.mixture import MixtureOrder

CASES = [[0.75, 0.25], [0.9, 0.1], [0.5, 0.3, 0.2], [0.4, 0.3, 0.15, 0.1, 0.05], [0.97, 0.02, 0.01]]
BATCHES = [8, 32, 96, 256]


def sources(order: MixtureOrder, n: int) -> np.ndarray:
    return np.array([order.locate(p)[0] for p in range(n)], dtype=np.int64)


def measure(src: np.ndarray, shares: list[float], batch: int) -> tuple[float, float, float]:
    k, n = len(shares), len(src)
    onehot = np.zeros((n, k))
    onehot[np.arange(n), src] = 1
    prefix = np.cumsum(onehot, axis=0) - np.outer(np.arange(1, n + 1), shares)
    worst_prefix = float(np.abs(prefix).max())
    per_batch = onehot[: n - n % batch].reshape(-1, batch, k).sum(axis=1) - batch * np.asarray(shares)
    spread = np.abs(per_batch).max(axis=1)
    return worst_prefix, float(spread.max()), float(spread.mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=20000)
    args = ap.parse_args()
    print(f"first {args.positions} positions; errors in samples (|drawn - share x count|)")
    print(f"{'weights':<28} {'B':>4} | {'shuffled: prefix':>16} {'batch max':>9} {'batch mean':>10} | "
          f"{'deficit: prefix':>15} {'batch max':>9} {'batch mean':>10}")
    for shares in CASES:
        rules = {rule: sources(MixtureOrder([100] * len(shares), shares, seed=0, shuffle=False, interleave=rule),
                               args.positions) for rule in ("shuffled", "deficit")}
        for batch in BATCHES:
            a, b = (measure(rules[r], shares, batch) for r in ("shuffled", "deficit"))
            print(f"{str(shares):<28} {batch:>4} | {a[0]:>16.2f} {a[1]:>9.2f} {a[2]:>10.2f} | "
                  f"{b[0]:>15.2f} {b[1]:>9.2f} {b[2]:>10.2f}")
        first = {r: np.bincount(rules[r][:96], minlength=len(shares)) / 96 for r in rules}
        print(f"{'':<28} first 96: shuffled {np.round(first['shuffled'], 3).tolist()}, "
              f"deficit {np.round(first['deficit'], 3).tolist()}")


if __name__ == "__main__":
    main()
