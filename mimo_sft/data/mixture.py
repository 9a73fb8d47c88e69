"""Dataset mixtures: several sources read as one, drawn in fixed shares, each with epochs of its own.

Why a global index space: everything downstream of the sampler (workers, reordering by index or by
exchange, the colocated split, bad-sample counting) handles "dataset index i". ``MixtureSource``
makes its sources one dataset whose indices are their concatenation (index ``offsets[s] + row``),
so none of that changes. The mixture lives in the *order* instead: :class:`MixtureOrder` maps
stream position ``p`` (0, 1, 2, ... over the whole run, no global epochs) to a global index, and
``CanonicalSampler`` cuts that stream into micro-batches and canonical-grid shares as it cuts a
single dataset's, so every module and every DP size reads the same global order.

The interleave (which source position ``p`` draws from) is a pure function of the shares, never of the
sources' sizes: positions come in chunks of ``C`` (1024, or the power of two that gives the smallest
share at least one draw); every chunk holds exactly ``quota[s]`` draws of source ``s`` (largest-remainder
apportionment of ``C * share``). Inside a chunk each position draws from the source furthest behind its
share: its next draw is released and due first (:func:`deficit_pattern`, Tijdeman's chairman assignment;
the simpler largest-deficit rule of Megatron's blended dataset drifts past one sample with five sources), so
every prefix of the stream -- each global batch, a short run -- holds each source's count within one sample
of its share (measured: ``scripts/bench_mixture_shares.py``). A chunk ends with every count at its quota, so every chunk repeats
the same pattern, and the draws of source ``s`` before position ``p`` are ``chunk * quota[s]`` plus its
count inside the chunk: resuming at ``consumed_samples`` needs no replay. Checkpoints written before this
rule (``interleave`` absent from meta.json's ``mixture``) resume on the rule they were trained with,
``"shuffled"``: each chunk's quotas shuffled by a generator seeded with ``(seed, chunk)``, whose shares
held only at chunk boundaries (a 0.75/0.25 mixture drew 0.66/0.34 over its first 96 samples).

Per-source epochs: the ``n``-th draw of source ``s`` reads row ``perm_s(e)[j]`` with
``(e, j) = divmod(n, rows_s)``: rows in order (``--dataloader-type single``) or a permutation seeded
with ``(seed, s, e)`` (``cyclic``). A small source repeats (a new epoch, reshuffled with cyclic); a
large one is never restarted by the others. A streaming source (parquet shards, WebDataset) only
needs "the ``n``-th draw of source ``s``", in order: the interleave above tells it how many draws
it has served at any position (docs/data.md).
"""

from __future__ import annotations

import bisect
from typing import Any, Optional

import numpy as np
import torch

from mimo_sft.errors import UserError

#: smallest chunk of the interleave (positions with fixed per-source counts)
MIN_CHUNK = 1024
MAX_CHUNK = 1 << 24
#: the deficit interleave's largest exact chunk, and its rounded chunk where the shares need more
EXACT_CHUNK = 1 << 16
_SEED_MASK = (1 << 63) - 1
#: how positions are spread over sources inside a chunk: "deficit" (every prefix within one sample of the
#: shares), "shuffled" (what checkpoints written before it were trained with)
INTERLEAVES = ("deficit", "shuffled")


def deficit_pattern(quota: list[int]) -> np.ndarray:
    """The source of each position of a chunk of ``C = sum(quota)`` positions, so that at every prefix ``t``
    each source's count stays within ``1 - 1/(2k - 2)`` of ``t * quota[s] / C`` (``k`` sources): Tijdeman's
    chairman assignment, as an earliest-deadline rule. The ``n``-th draw of source ``s`` may come once
    ``t >= (n + σ) / λ`` and is due by ``(n + 1 - σ) / λ`` (``λ = quota[s] / C``, ``σ = 1/(2k - 2)``); each
    position takes the released draw due first (ties: the lower source). Computed in integers (times
    ``2k - 2``), so every rank builds the same pattern. The chunk ends with every source at its quota."""
    q = [int(x) for x in quota]
    total, k = sum(q), len(q)
    if k == 1:
        return np.zeros(total, dtype=np.int64)
    m = 2 * k - 2  # σ = 1 / m
    counts = [0] * k
    out = np.empty(total, dtype=np.int64)
    for t in range(1, total + 1):
        best = None  # (deadline numerator, its denominator q[s], s): deadline (n*m + m - 1) / (m * q[s]) * C
        for s, qs in enumerate(q):
            n = counts[s]
            if n >= qs or (n * m + 1) * total > t * qs * m:  # its quota met, or its next draw not released yet
                continue
            due = n * m + m - 1
            if best is None or due * best[1] < best[0] * qs:
                best = (due, qs, s)
        if best is None:  # nothing released (not reached for exact quotas): the source furthest behind
            best = (0, 1, max((s for s in range(k) if counts[s] < q[s]), key=lambda s: q[s] * t - total * counts[s]))
        out[t - 1] = best[2]
        counts[best[2]] += 1
    return out


def apportion(total: int, shares: list[float]) -> list[int]:
    """Integers summing to ``total``, each ``floor(total * share)`` plus one for the largest
    remainders (ties: the lower source index)."""
    raw = [total * s for s in shares]
    out = [int(np.floor(r)) for r in raw]
    left = total - sum(out)
    order = sorted(range(len(shares)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[:left]:
        out[i] += 1
    return out


def exact_chunk(shares: list[float]) -> Optional[int]:
    """The smallest chunk whose quotas are the shares exactly (the shares' common denominator, as fractions
    of at most :data:`EXACT_CHUNK`; "3,1" gives 4 and "0.5,0.3,0.2" gives 10), or None when the shares are not
    such fractions (then the quotas round them: :func:`chunk_size`)."""
    from fractions import Fraction
    from math import lcm

    fracs = [Fraction(s).limit_denominator(EXACT_CHUNK) for s in shares]
    if sum(fracs) != 1 or any(abs(float(f) - s) > 1e-12 for f, s in zip(fracs, shares)):
        return None
    c = lcm(*(f.denominator for f in fracs))
    return c if c <= EXACT_CHUNK else None


def chunk_size(shares: list[float], names: Optional[list[str]] = None, *, start: int = MIN_CHUNK) -> int:
    """The interleave's chunk: the smallest power of two >= ``start`` giving every positive share a draw."""
    c = start
    while c <= MAX_CHUNK:
        q = apportion(c, shares)
        if all(qi > 0 for qi, s in zip(q, shares) if s > 0):
            return c
        c *= 2
    small = min((s, i) for i, s in enumerate(shares) if s > 0)
    name = names[small[1]] if names else str(small[1])
    raise UserError(f"source '{name}': its share {small[0]:.2e} is below 1/{MAX_CHUNK}; raise its weight "
                    "or leave it out")


class MixtureOrder:
    """Stream position -> global index of a mixture (module docstring); pure in its arguments."""

    def __init__(self, sizes: list[int], shares: list[float], *, seed: int, shuffle: bool,
                 names: Optional[list[str]] = None, interleave: str = "deficit"):
        assert len(sizes) == len(shares) and all(n > 0 for n, s in zip(sizes, shares) if s > 0)
        assert interleave in INTERLEAVES, interleave
        self.interleave = interleave
        self.sizes, self.shares = list(sizes), list(shares)
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.seed, self.shuffle = int(seed) & _SEED_MASK, shuffle
        # deficit: quotas exact where the shares are small fractions (every prefix then within one sample of
        # the weights for the whole run), else rounded over 2^16 positions (a drift of one sample per 2^17)
        self.chunk = (chunk_size(self.shares, names) if interleave == "shuffled" else
                      exact_chunk(self.shares) or chunk_size(self.shares, names, start=EXACT_CHUNK))
        self.quota = np.array(apportion(self.chunk, self.shares), dtype=np.int64)
        self._chunk_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._pattern: Optional[np.ndarray] = None
        self._epoch_cache: dict[tuple[int, int], np.ndarray] = {}

    def chunk_sources(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, draw number)`` of every position of chunk ``c``."""
        hit = self._chunk_cache.get(c)
        if hit is not None:
            return hit
        if self.interleave == "deficit":
            if self._pattern is None:  # the same in every chunk (each ends with every count at its quota)
                self._pattern = deficit_pattern(self.quota.tolist())
            src = self._pattern
        else:
            base = np.repeat(np.arange(len(self.sizes), dtype=np.int64), self.quota)
            src = base[np.random.default_rng([self.seed, 0, c]).permutation(self.chunk)]
        draw = np.empty(self.chunk, dtype=np.int64)
        for s in range(len(self.sizes)):
            where = np.nonzero(src == s)[0]
            draw[where] = c * self.quota[s] + np.arange(len(where))
        if len(self._chunk_cache) > 2:
            self._chunk_cache.clear()
        self._chunk_cache[c] = (src, draw)
        return src, draw

    def epoch_rows(self, s: int, epoch: int) -> Optional[np.ndarray]:
        """Source ``s``'s row order in its epoch ``epoch`` (None: rows in order)."""
        if not self.shuffle:
            return None
        key = (s, epoch)
        hit = self._epoch_cache.get(key)
        if hit is None:
            if len(self._epoch_cache) > 2 * len(self.sizes):
                self._epoch_cache.clear()
            hit = self._epoch_cache[key] = np.random.default_rng([self.seed, 1 + s, epoch]).permutation(self.sizes[s])
        return hit

    def draw(self, s: int, n: int) -> int:
        """Global index of the ``n``-th draw of source ``s``."""
        epoch, j = divmod(int(n), self.sizes[s])
        rows = self.epoch_rows(s, epoch)
        return self.offsets[s] + (j if rows is None else int(rows[j]))

    def locate(self, p: int) -> tuple[int, int]:
        """``(source, draw number)`` of stream position ``p``."""
        c, i = divmod(int(p), self.chunk)
        src, draw = self.chunk_sources(c)
        return int(src[i]), int(draw[i])

    def indices(self, start: int, stop: int) -> list[int]:
        """Global indices of positions ``[start, stop)``."""
        return [self.draw(*self.locate(p)) for p in range(start, stop)]

    def draws_before(self, p: int) -> list[int]:
        """Per source, the draws served before position ``p`` (a streaming source's resume point)."""
        c, i = divmod(int(p), self.chunk)
        src, _ = self.chunk_sources(c)
        return [int(c * self.quota[s] + np.count_nonzero(src[:i] == s)) for s in range(len(self.sizes))]


class MixtureSource:
    """Several ``SFTSource`` as one dataset (global index = ``offsets[s] + row``); picklable for
    DataLoader workers. ``shares``: each source's share of the drawn samples (summing to 1)."""

    def __init__(self, parts: list, names: list[str], shares: list[float]):
        assert len(parts) == len(names) == len(shares) and parts
        self.parts, self.names, self.shares = list(parts), list(names), list(shares)
        #: the rule of :class:`MixtureOrder`; a resume takes its checkpoint's (:func:`check_resumed_mixture`)
        self.interleave = "deficit"
        self.sizes = [len(p) for p in parts]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.dataset_path = ", ".join(f"{n}={getattr(p, 'dataset_path', '?')}" for n, p in zip(names, parts))

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, idx: int) -> tuple[int, int]:
        """``(source, row)`` of global index ``idx``."""
        s = bisect.bisect_right(self.offsets, int(idx)) - 1
        assert 0 <= s < len(self.parts), f"index {idx} outside the mixture's {len(self)} rows"
        return s, int(idx) - self.offsets[s]

    def __getitem__(self, idx: int) -> tuple[list[dict], list[Any]]:
        s, row = self.locate(idx)
        return self.parts[s][row]

    def next_index(self, idx: int) -> int:
        """The index that stands in for ``idx`` (truncation policy): the next row of the same source."""
        s, row = self.locate(idx)
        return self.offsets[s] + (row + 1) % self.sizes[s]

    def source_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The source number of each global index in ``ids`` (int64)."""
        bounds = torch.tensor(self.offsets[1:-1], dtype=torch.int64)
        return torch.bucketize(ids.to(torch.int64), bounds, right=True)

    def order(self, *, seed: int, shuffle: bool) -> MixtureOrder:
        return MixtureOrder(self.sizes, self.shares, seed=seed, shuffle=shuffle, names=self.names,
                            interleave=self.interleave)

    def image_paths(self) -> list[tuple[int, str]]:
        return [(off + row, path) for p, off in zip(self.parts, self.offsets) for row, path in p.image_paths()]

    def check_image_files(self) -> None:
        for p in self.parts:
            p.check_image_files()

    def rows_text(self, drawn: int | None = None) -> str:
        """``name rows (share, streamed, times read)`` of every source, for the run's banner; ``drawn``: the
        samples the run draws (``--train-iters`` x global batch), for how many times each source is read."""
        return ", ".join(f"{n} {r} rows ({100 * s:.1f}%" + (", streamed" if getattr(p, "streaming", False) else "")
                         + (f", read {s * drawn / r:.2f} times" if drawn else "") + ")"
                         for n, r, s, p in zip(self.names, self.sizes, self.shares, self.parts))

    def epochs(self, order: MixtureOrder, consumed_samples: int) -> list[float]:
        """How many times each source has been read after ``consumed_samples`` stream positions (its draws over
        its rows; ``order``: this mixture's :meth:`order`)."""
        return [d / r for d, r in zip(order.draws_before(consumed_samples), self.sizes)]

    def fingerprint(self) -> dict:
        """What a checkpoint records so that a resume reads the same mixture (names, rows, shares)."""
        return {"names": self.names, "rows": self.sizes, "shares": [round(s, 12) for s in self.shares],
                "interleave": self.interleave}


class InterleavedView:
    """A mixture's rows read round-robin over its sources (row 0 of each, row 1 of each, ...; a
    finished source drops out): a validation set whose every prefix (``--eval-iters``) holds every
    source."""

    def __init__(self, mixture: MixtureSource):
        self.mixture = mixture
        self.names = mixture.names
        self.dataset_path = mixture.dataset_path
        self.map = [mixture.offsets[s] + r for r in range(max(mixture.sizes))
                    for s in range(len(mixture.sizes)) if r < mixture.sizes[s]]

    def __len__(self) -> int:
        return len(self.map)

    def __getitem__(self, i: int):
        return self.mixture[self.map[int(i)]]

    def source_of(self, ids: torch.Tensor) -> torch.Tensor:
        mapped = torch.tensor([self.map[int(i)] for i in ids.tolist()], dtype=torch.int64)
        return self.mixture.source_of(mapped)


def resumed_interleave(saved: Optional[dict]) -> Optional[str]:
    """The interleave a resumed mixture continues with: its checkpoint's (``saved``: meta.json's ``mixture``),
    ``"shuffled"`` for one written before the rule was recorded; None when there is no saved mixture."""
    if not saved:
        return None
    rule = saved.get("interleave", "shuffled")
    if rule not in INTERLEAVES:
        raise UserError(f"the checkpoint's mixture was interleaved by '{rule}', which this mimo-sft does not know "
                        f"({', '.join(INTERLEAVES)}); resume it with the mimo-sft that wrote it")
    return rule


def check_resumed_mixture(saved: Optional[dict], source, *, checkpoint: str) -> None:
    """A resume must read the mixture the checkpoint was trained on: ``consumed_samples`` is a
    position of its interleave, which depends on the shares, and rows name other samples if a
    source's row count changed. ``saved``: meta.json's ``mixture`` (None: none recorded)."""
    now = source.fingerprint() if isinstance(source, MixtureSource) else None
    if saved is None and now is None:
        return
    if saved is None or now is None:
        was = "a mixture of " + ", ".join(saved["names"]) if saved else "one --dataset-path"
        raise UserError(f"--load-checkpoint {checkpoint} was trained on {was}; resume with the same sources, or "
                        f"start from its weights with --pretrained-checkpoint {checkpoint}")
    # by position: names are labels (a source renamed in YAML is the same source); rows and shares decide
    # which sample a position names
    for key, what in (("rows", "row counts"), ("shares", "shares (--dataset-weights)")):
        if list(saved.get(key, now[key])) != list(now[key]):
            raise UserError(f"--load-checkpoint {checkpoint}: the mixture's {what} differ from the checkpoint's "
                            f"({saved[key]} then, {now[key]} now); resume with the same sources and weights, or start "
                            f"from its weights with --pretrained-checkpoint {checkpoint}")


def load_mixture(specs, load_one) -> MixtureSource:
    """The sources of ``specs`` (``config.mixture.SourceSpec``), each opened by ``load_one(data_cfg)``;
    a source that cannot be opened or holds no samples is named in the one-line error."""
    parts = []
    for spec in specs:
        try:
            part = load_one(spec.data)
        except UserError as e:
            raise UserError(f"source '{spec.name}': {e}") from None
        if len(part) == 0:
            raise UserError(f"source '{spec.name}' ({spec.data.dataset_path}) has no samples left; drop it or "
                            "fix its rows")
        parts.append(part)
    return MixtureSource(parts, [s.name for s in specs], [s.weight for s in specs])
