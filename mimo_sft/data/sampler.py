"""Canonical-grid sampler: which dataset indices this DP rank reads for each global micro-batch.

Why: modules with different DP sizes (vision DP 2, language DP 4, ...) must agree on which samples
form global micro-batch k and in which order, without talking to each other. Global micro-batch k
is ``micro_batch_size`` consecutive positions of the epoch order; DP rank r of a module with DP size
d takes positions ``[r*MBS/d, (r+1)*MBS/d)``, i.e. canonical groups ``[r*G/d, (r+1)*G/d)`` with
``G = lcm(all module DP sizes)``. The order is a pure function of (dataset length, seed, epoch), so
resuming from ``consumed_samples`` continues the exact stream, across epoch boundaries too.

Epochs: ``single`` reads 0..N-1 every epoch; ``cyclic`` reshuffles each epoch with seed + epoch.
``drop_last=True`` drops the incomplete last micro-batch of an epoch; ``drop_last=False`` fills it
with the first positions of the same epoch's order (every rank must see a full micro-batch).
The stream is endless; the training loop stops after its iterations.

Mixtures (``order``, a ``data.mixture.MixtureOrder``): the stream has no global epochs -- position
``p`` is the mixture's draw ``p`` (each source with epochs of its own), and micro-batch k is
positions ``[k*MBS, (k+1)*MBS)``, cut into shares exactly as above; ``drop_last`` plays no part.
"""

from __future__ import annotations

from typing import Iterator

import torch


class RankShare:
    """The positions of a micro-batch one DP rank reads: ``[r*MBS/d, (r+1)*MBS/d)``, or all of them
    (``whole_micro_batch``: without scalable DP a rank reads everything and slices later).

    Why one class: the training sampler and the validation sampler (``data.validation``) must cut a
    micro-batch into the same shares, so both take theirs from here.
    """

    def __init__(self, micro_batch_size: int, dp_size: int, dp_rank: int, whole_micro_batch: bool):
        self.mbs = micro_batch_size
        self.whole = whole_micro_batch
        per = micro_batch_size // dp_size
        self.slice = (dp_rank * per, (dp_rank + 1) * per)

    def share(self, full: list[int]) -> list[int]:
        """This rank's part of ``full``, a whole micro-batch's indices in position order."""
        return full if self.whole else full[self.slice[0]: self.slice[1]]


class CanonicalSampler(RankShare):
    """Yields, per global micro-batch, this rank's list of dataset indices (canonical order)."""

    def __init__(self, total_samples: int, *, micro_batch_size: int, canonical_grid: int, dp_size: int,
                 dp_rank: int, dataloader_type: str = "single", drop_last: bool = True,
                 consumed_samples: int = 0, seed: int = 0, whole_micro_batch: bool = False, order=None):
        assert total_samples > 0, "empty dataset"
        assert micro_batch_size % canonical_grid == 0, (
            f"micro_batch_size {micro_batch_size} must be a multiple of the canonical grid {canonical_grid}")
        assert canonical_grid % dp_size == 0, f"canonical grid {canonical_grid} must be a multiple of dp size {dp_size}"
        assert 0 <= dp_rank < dp_size, f"dp_rank {dp_rank} outside [0, {dp_size})"
        assert dataloader_type in ("single", "cyclic"), dataloader_type
        assert order is not None or total_samples >= micro_batch_size, "dataset smaller than one micro-batch"
        assert consumed_samples % micro_batch_size == 0, (
            f"consumed_samples {consumed_samples} is not a multiple of micro_batch_size {micro_batch_size}")
        super().__init__(micro_batch_size, dp_size, dp_rank, whole_micro_batch)
        self.total = total_samples
        self.grid = canonical_grid
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.type = dataloader_type
        self.drop_last = drop_last
        self.consumed = consumed_samples
        self.seed = seed
        self.order = order  # a mixture's stream (module docstring); None: one dataset's epochs

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.total // self.mbs if self.drop_last else -(-self.total // self.mbs)

    @property
    def samples_per_epoch(self) -> int:
        return self.micro_batches_per_epoch * self.mbs

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Dataset indices of one epoch's positions (deterministic in seed + epoch)."""
        if self.type == "single":
            order = torch.arange(self.total)
        else:
            g = torch.Generator()
            g.manual_seed(int(self.seed) + int(epoch))
            order = torch.randperm(self.total, generator=g)
        n = self.samples_per_epoch
        if n > self.total:  # drop_last=False: wrap to fill the last micro-batch
            order = torch.cat([order, order[: n - self.total]])
        return order[:n]

    def global_micro_batch(self, k: int) -> list[int]:
        """All ``micro_batch_size`` indices of global micro-batch k (counted from the stream start)."""
        if self.order is not None:
            return self.order.indices(k * self.mbs, (k + 1) * self.mbs)
        per_epoch = self.micro_batches_per_epoch
        epoch, j = divmod(k, per_epoch)
        return self.epoch_order(epoch)[j * self.mbs: (j + 1) * self.mbs].tolist()

    def rank_indices(self, k: int) -> list[int]:
        return self.share(self.global_micro_batch(k))

    def canonical_groups(self) -> range:
        """Canonical groups this rank reads: ``[r*G/d, (r+1)*G/d)``."""
        per = self.grid // self.dp_size
        return range(self.dp_rank * per, (self.dp_rank + 1) * per)

    def __iter__(self) -> Iterator[list[int]]:
        k = self.consumed // self.mbs
        if self.order is not None:
            while True:
                yield self.share(self.order.indices(k * self.mbs, (k + 1) * self.mbs))
                k += 1
        cached_epoch, order = None, None
        per_epoch = self.micro_batches_per_epoch
        while True:
            epoch, j = divmod(k, per_epoch)
            if epoch != cached_epoch:
                cached_epoch, order = epoch, self.epoch_order(epoch)
            yield self.share(order[j * self.mbs: (j + 1) * self.mbs].tolist())
            k += 1
