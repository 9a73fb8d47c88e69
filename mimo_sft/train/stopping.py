"""Stopping a run cleanly before its last step: a signal, a step count, a wall-time budget.

Shared clusters end jobs: a time limit, a preemption (SLURM can send SIGUSR1 ahead of the kill,
then SIGTERM). With ``--exit-signal-handler`` a signal only sets a flag; the step in flight
finishes. After every step each rank says whether it wants to stop (its own signal flag, the step
count, its own clock) and one tiny all-reduce (MAX over the world) makes the decision common, so a
signal that reached a single rank stops every rank at the same step and nobody hangs in a
collective the others skipped. The trainer then writes one checkpoint and exits 0, printing the
command that resumes.
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from typing import Optional

#: why a run stops early; the index is what the ranks all-reduce (MAX: a signal wins)
REASONS = (None, "--exit-interval", "--exit-duration-in-mins", "a signal")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopPolicy:
    """One rank's view of ``--exit-signal-handler``, ``--exit-interval`` and ``--exit-duration-in-mins``."""

    def __init__(self, *, signal_handler: bool, exit_interval: Optional[int], exit_duration_mins: Optional[float],
                 clock=time.monotonic):
        self.exit_interval = exit_interval
        self.limit_s = exit_duration_mins * 60.0 if exit_duration_mins else None
        self.clock = clock
        self.started = clock()
        self.signal_received: Optional[int] = None
        self.signal_handler = signal_handler
        if signal_handler:
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signal_received = signum

    @property
    def active(self) -> bool:
        """Whether any rule is set (the same on every rank: it comes from the config)."""
        return self.signal_handler or self.exit_interval is not None or self.limit_s is not None

    def local_reason(self, step: int, last_step_s: float) -> int:
        """Index into :data:`REASONS` of why this rank would stop after ``step`` (0: it would not).

        The time budget stops a run when one more step of the last step's length would not finish
        inside it, so the checkpoint is written before the budget is gone.
        """
        if self.signal_received is not None:
            return 3
        if self.limit_s is not None and self.clock() - self.started + last_step_s >= self.limit_s:
            return 2
        if self.exit_interval and step % self.exit_interval == 0:
            return 1
        return 0


def agree(reason: int, group) -> int:
    """The common decision: the largest reason any rank of ``group`` (the world) gives. Collective."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([reason], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def resume_command(save_dir: str, world_size: int, argv: Optional[list[str]] = None,
                   launch_flags: Optional[str] = None) -> str:
    """The command that continues this run from ``save_dir``: the same flags, ``--load-checkpoint``; started the
    way this run was -- ``mimo-sft COMMAND`` with the launch flags of mimo-sft's own launcher (``launch_flags``,
    default: what the launcher left in the environment, ``train.elastic.LAUNCH_FLAGS_ENV``), else torchrun."""
    import os

    from mimo_sft.train.elastic import LAUNCH_FLAGS_ENV

    args = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--load-checkpoint":
            skip = True
            continue
        if a.startswith("--load-checkpoint="):
            continue
        out.append(a)
    words = [shlex.quote(a) for a in out] + ["--load-checkpoint", shlex.quote(save_dir)]
    launch_flags = os.environ.get(LAUNCH_FLAGS_ENV) if launch_flags is None else launch_flags
    if launch_flags and out:
        return " ".join(["mimo-sft", words[0], launch_flags, *words[1:]])
    return " ".join(["torchrun", "--nproc-per-node", str(world_size), "-m", "mimo_sft", *words])
