"""The straggler report: which rank is slow, by how much, and where its time goes.

Why not the step time: a step is synchronous, so every rank's wall time per step is the same -- the fast ranks
spend the straggler's extra seconds waiting for it. What differs is where the time goes. Each rank books its step's
seconds per phase (``mimo_sft.progress``: data wait, encoder/language forward and backward, optimizer, compute
between them, and the phases that wait on other ranks: the bridge, gradient finalize, reorder wait). A rank's
**work** is its step time less those waits; the straggler is the rank whose work is largest against the median of
its **peers** (the ranks that hold the same modules: an encoder rank is compared with encoder ranks, never with a
language rank, whose work is of another size). A rank without peers (a module of DP 1) is compared with nobody.

How the figures travel: every ``--log-interval`` steps each rank's means per step over the interval (its step time
and phase seconds) ride in the world all-reduce the step's model FLOPs already take (``train.metrics.
step_model_flops``: each rank fills its own slot of a ``world x ROW`` block, the sum is the gather), so the report
adds no collective. The metrics rank then:

* names the slowest rank on the progress line: ``slowest rank 5 +31 % (encoder forward)`` -- its work over the
  median of its peers', and the phase with the most seconds over the peers' median of that phase;
* writes the per-rank figures to metrics.jsonl (``rank_step_s``, ``rank_work_s``, ``rank_phase_s``, the work it
  was given, ``rank_patches`` and ``rank_tokens`` (what ``--reorder-calibrate-from`` fits the phases on), and
  ``slowest_rank``, ``slowest_excess``, ``slowest_phase``), read back by ``mimo-sft summarize``;
* warns once, with the rank's host, when a rank's work stays above ``--straggler-threshold`` times its peers'
  median for :data:`INTERVALS` log intervals in a row.

Limits: a wait inside a phase counted as work (a tensor-parallel all-reduce inside a forward, a parameter gather
overlapped with it) lends the straggler's seconds to its peers and hides part of its excess.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from mimo_sft.progress import COMPUTE, PROGRESS

#: the booked phases, in the order of a rank's row (after its step time); any other phase is booked as compute
PHASES = ("data wait", "reorder wait", "encoder forward", "encoder backward", "bridge", "language forward",
          "language backward", "gradient finalize", "optimizer", COMPUTE)
#: phases that wait on other ranks: not this rank's work
WAITS = frozenset({"reorder wait", "bridge", "gradient finalize"})
#: the work a rank was given, after its phases: its encoder slice's patches, its language slice's real tokens
#: over language tp (``train.feed``); what ``config.calibration`` fits the encoder and language seconds on
LOADS = ("patches", "tokens")
#: figures per rank: its step time, its seconds in each phase, then its :data:`LOADS` (means per step over the
#: interval)
ROW = 1 + len(PHASES) + len(LOADS)
#: consecutive log intervals above the threshold before a rank is flagged
INTERVALS = 3
#: test hook: ``RANK:SECONDS`` -- that rank sleeps that long in each data wait (``mimo_sft.progress``)
SLOW_ENV = "MIMO_SFT_TEST_SLOW_RANK"


def phase_row(step_s: float, seconds: dict[str, float], loads: Sequence[float] = (0.0, 0.0)) -> list[float]:
    """One step's row: its time, the seconds of each of :data:`PHASES` (others booked as compute), its loads."""
    row = [step_s] + [0.0] * len(PHASES) + [float(x) for x in loads]
    for name, s in seconds.items():
        i = PHASES.index(name) if name in PHASES else PHASES.index(COMPUTE)
        row[1 + i] += s
    return row


def work_s(row: Sequence[float]) -> float:
    """A rank's work: its step time less its waits on other ranks."""
    return max(0.0, row[0] - sum(row[1 + i] for i, p in enumerate(PHASES) if p in WAITS))


_WAIT_COLUMNS = [1 + i for i, p in enumerate(PHASES) if p in WAITS]


def works(table) -> np.ndarray:
    """:func:`work_s` of every row of ``table`` (ranks x :data:`ROW`)."""
    t = np.asarray(table, dtype=np.float64).reshape(-1, ROW)
    return np.maximum(0.0, t[:, 0] - t[:, _WAIT_COLUMNS].sum(axis=1))


def roles(layout) -> list[tuple[str, ...]]:
    """Each rank's modules: the ranks of equal roles are peers."""
    return [tuple(sorted(layout.coords(r))) for r in range(layout.world_size)]


def _medians_without(ordered: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each of ``values`` (members of the sorted ``ordered``), the median of ``ordered`` with one copy of it
    left out."""
    n = len(ordered)
    m = n - 1
    pos = np.searchsorted(ordered, values, side="left")

    def at(k: int) -> np.ndarray:  # the k-th of the list without position pos (k <= m - 1 < n - 1)
        return np.where(k < pos, ordered[k], ordered[k + 1])

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def ratios(table, role: Sequence[tuple]) -> dict[int, float]:
    """Each rank's work over the median work of its peers (the other ranks of its role); ranks without peers, or
    whose peers did no measurable work, are left out. One sort per role: a world of thousands takes milliseconds."""
    work = works(table)
    members: dict[tuple, list[int]] = {}
    for r, key in enumerate(role):
        members.setdefault(key, []).append(r)
    out = {}
    for idx in members.values():
        if len(idx) < 2:
            continue
        mine = work[idx]
        medians = _medians_without(np.sort(mine), mine)
        out.update({r: float(w / md) for r, w, md in zip(idx, mine, medians) if md > 0})
    return out


@dataclass(frozen=True)
class Slowest:
    rank: int
    excess: float  # work over the peers' median, as a fraction (0.31: +31 %)
    phase: str  # the phase with the most seconds over the peers' median of it
    phase_excess_s: float


def excess_phase(table, role: Sequence[tuple], rank: int) -> tuple[str, float]:
    """The phase of ``rank`` (waits left out) with the most seconds over its peers' median of that phase."""
    t = np.asarray(table, dtype=np.float64).reshape(-1, ROW)
    peers = [q for q in range(len(t)) if q != rank and role[q] == role[rank]]
    best, best_s = COMPUTE, float("-inf")
    for i, name in enumerate(PHASES):
        if name in WAITS or not peers:
            continue
        extra = float(t[rank, 1 + i] - np.median(t[peers, 1 + i]))
        if extra > best_s:
            best, best_s = name, extra
    return best, best_s


def slowest(table: Sequence[Sequence[float]], role: Sequence[tuple],
            r_of: dict[int, float] | None = None) -> Optional[Slowest]:
    """The rank with the largest work over its peers' median (``r_of``: :func:`ratios`, when known), and the phase
    its excess is in (pure)."""
    r_of = ratios(table, role) if r_of is None else r_of
    if not r_of:
        return None
    rank = max(r_of, key=lambda r: (r_of[r], -r))
    return Slowest(rank, r_of[rank] - 1.0, *excess_phase(table, role, rank))


def progress_text(s: Optional[Slowest]) -> str:
    """The progress line's part: ``slowest rank 5 +31 % (encoder forward)``."""
    return "" if s is None else f" | slowest rank {s.rank} {100 * s.excess:+.0f} % ({s.phase})"


class Flagger:
    """Counts each rank's consecutive intervals above the threshold; one warning line when a count reaches
    :data:`INTERVALS` (again only after the rank fell below and rose again)."""

    def __init__(self, threshold: float, hosts: Sequence[str], intervals: int = INTERVALS):
        self.threshold, self.hosts, self.intervals = threshold, list(hosts), intervals
        self.counts: dict[int, int] = {}

    def see(self, table: Sequence[Sequence[float]], role: Sequence[tuple], step: int,
            r_of: dict[int, float] | None = None) -> list[str]:
        lines = []
        for rank, ratio in sorted((ratios(table, role) if r_of is None else r_of).items()):
            self.counts[rank] = self.counts.get(rank, 0) + 1 if ratio > self.threshold else 0
            if self.counts[rank] == self.intervals:
                host = self.hosts[rank] if rank < len(self.hosts) else "?"
                phase, extra = excess_phase(table, role, rank)
                lines.append(f"mimo-sft: warning: straggler: rank {rank} on host {host} has worked {ratio:.2f}x the "
                             f"median of its peers ({'+'.join(role[rank])} ranks) for {self.intervals} log intervals "
                             f"in a row up to step {step}, most in {phase} (+{extra:.2f} s/step); every rank waits for "
                             f"it: check that host (other jobs, clocks, disk, network) or leave it out "
                             f"(--straggler-threshold {self.threshold:g})")
        return lines


class StragglerReport:
    """One rank's part: its sums over the current interval (every rank), the gathered block's analysis (the
    metrics rank). Every rank calls :meth:`figures` at every step, so the all-reduce stays matched."""

    def __init__(self, *, rank: int, world_size: int, layout, log_interval: int, total_steps: int,
                 threshold: float, hosts: Sequence[str]):
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.log_interval, self.total_steps = max(1, log_interval), total_steps
        self.role = roles(layout)
        self.flagger = Flagger(threshold, hosts)
        self._sum = [0.0] * ROW
        self._steps = 0

    def add(self, step_s: float, seconds: dict[str, float], loads: Sequence[float] = (0.0, 0.0)) -> None:
        self._sum = [a + b for a, b in zip(self._sum, phase_row(step_s, seconds, loads))]
        self._steps += 1

    def is_log_step(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.total_steps

    def figures(self, step: int) -> list[float]:
        """What this rank adds to the all-reduce after ``step``: at a log step its block (its own slot filled
        with its means per step), else nothing."""
        if not self.is_log_step(step) or self.world_size < 2:
            return []
        block = [0.0] * (self.world_size * ROW)
        n = max(self._steps, 1)
        block[self.rank * ROW:(self.rank + 1) * ROW] = [v / n for v in self._sum]
        self._sum, self._steps = [0.0] * ROW, 0
        return block

    def analyse(self, step: int, block: Sequence[float]) -> dict:
        """The metrics rank's part: the metrics.jsonl figures of the gathered ``block`` (empty when there is
        none), and any warning printed."""
        if not block:
            return {}
        table = np.asarray(block, dtype=np.float64).reshape(self.world_size, ROW)
        r_of = ratios(table, self.role)
        for line in self.flagger.see(table, self.role, step, r_of):
            print(line, flush=True)
        out = {"rank_step_s": np.round(table[:, 0], 4).tolist(), "rank_work_s": np.round(works(table), 4).tolist(),
               "rank_phase_s": {p: np.round(table[:, 1 + i], 4).tolist() for i, p in enumerate(PHASES)}}
        first = 1 + len(PHASES)
        out.update({f"rank_{name}": np.round(table[:, first + i], 3).tolist() for i, name in enumerate(LOADS)})
        s = slowest(table, self.role, r_of)
        if s is not None:
            out.update(slowest_rank=s.rank, slowest_excess=round(s.excess, 4), slowest_phase=s.phase)
        return out


def host_names(group) -> list[str]:
    """Every rank's host name, gathered once before step 0 (the warning names the host)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return [socket.gethostname()]
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts


def install_test_hook(rank: int) -> None:
    """The :data:`SLOW_ENV` hook, set on this rank's progress record."""
    hook = os.environ.get(SLOW_ENV)
    if hook:
        r, s = hook.split(":")
        PROGRESS._slow = (int(r), float(s))
