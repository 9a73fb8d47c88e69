"""``--max-bad-samples`` over the whole run: distinct bad samples counted across every rank, not per process.

A bad sample (an image or clip that does not read, a row that cannot be trained on) is met by every rank that
reads it -- a language rank and the encoder rank that decodes it, every DP rank of a micro-batch read whole
without ``--scalable-dp`` -- and, over epochs, by other ranks again. Each process's data iterator keeps the ones it
met first (``data.microbatch.MicroBatchIterator.first_seen``); after every step each rank puts how many it has into
the step's world all-reduce on the host group (``train.step_log``: the model-FLOPs one, no collective added, no
device read), and only where that sum is not zero do the ranks all-gather the samples themselves (index, where,
reason) over the same gloo group. Every rank then holds the same set: each sample is named once in the log (by the
metrics rank, with the run's count), counted once in ``bad_samples_skipped``, and past the limit every rank
refuses with the same line.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from mimo_sft.data.microbatch import skipped_line, too_many_bad_samples
from mimo_sft.errors import UserError

log = logging.getLogger("mimo_sft.data")


class BadSampleTally:
    """The run's distinct bad samples, the same on every rank (see the module docstring)."""

    def __init__(self, source, *, limit: int, group, announce: bool):
        #: the training data iterator (None: a source that keeps no bad samples)
        self.source = source if hasattr(source, "first_seen") else None
        if self.source is not None:
            self.source.tally_here = False
        self.limit, self.group, self.announce = limit, group, announce
        self.seen: dict[int, tuple] = {}  # index -> (where, reason), in the order they were counted
        self._mine: list[tuple] = []

    def local_count(self) -> float:
        """How many samples this process met first since the last step (taken now; the step's all-reduce
        carries the figure)."""
        if self.source is not None:
            queue = self.source.first_seen
            while queue:
                self._mine.append(queue.popleft())
        return float(len(self._mine))

    def merge(self, total: float) -> int:
        """Collective when ``total`` (the all-reduced :meth:`local_count`) is not zero: the samples every rank
        met, counted once each. Returns how many are new to the run; raises past ``--max-bad-samples``."""
        if total == 0:
            return 0
        parts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, self._mine, group=self.group)
        self._mine = []
        new = 0
        for index, where, reason in sorted({s[0]: s for part in parts for s in part}.values()):
            if index in self.seen:
                continue
            self.seen[index] = (where, reason)
            new += 1
            if self.announce:
                log.warning(skipped_line(index, where, reason, len(self.seen), self.limit))
        if len(self.seen) > self.limit:
            raise UserError(too_many_bad_samples(self.seen, self.limit))
        return new
