"""What the training thread is doing now, and how long it spent in each phase of the current step.

One record per process (:data:`PROGRESS`), written by the training thread through cheap attribute stores and
read by two consumers:

* the hang watchdog (``train.watchdog``): every phase entered or left is progress; a rank that makes none for
  ``--hang-timeout`` is dumped and named;
* the straggler report (``train.straggler``): the seconds of the step spent in each phase, so that the ranks
  can compare where their time went.

It lives outside ``train/`` because the data layer marks a phase too: index-mode reordering's cost all-gather,
when it runs on the training thread (loader without workers), is a wait on the DP peers inside the data wait
(:meth:`Progress.nested`), and must not count as this rank's own data work.

Phase names: those of ``train.profile.phase`` (step start, data wait, bridge, gradient finalize, optimizer,
evaluation, checkpoint save), the module phases of ``train.profile.ModulePhases`` (encoder forward, language
backward, ...), "reorder wait" nested in a data wait, and "compute after X" once a phase with an end of its own
has ended. For the seconds, "step start" and every "compute after X" are booked as "compute".
"""

from __future__ import annotations

import time

#: the seconds booked for "step start" and "compute after X" (the thread computes between named phases)
COMPUTE = "compute"


def booked_as(phase: str) -> str:
    """The name a phase's seconds are booked under."""
    return COMPUTE if phase == "step start" or phase.startswith("compute after") else phase


class Progress:
    """What the training thread last did; written by it (cheap attribute stores), read by the watchdog thread."""

    def __init__(self):
        self.step, self.microbatch, self.phase, self.entries = 0, 0, "start-up", 0
        self.last = time.monotonic()
        self.history: list[tuple[float, str]] = []  # this step's phases (time, name)
        self.rank = 0
        #: seconds of the current step per booked phase name (:func:`booked_as`), since :meth:`begin_step`
        self.seconds: dict[str, float] = {}
        self._hang_at: tuple[int, int] | None = None  # the watchdog's test hook (train.watchdog.HANG_AT_ENV)
        self._slow: tuple[int, float] | None = None  # the straggler report's test hook (train.straggler.SLOW_ENV)

    def _switch(self, phase: str) -> float:
        """Book the time since the last switch to the phase that ends, make ``phase`` current; the time now."""
        now = time.monotonic()
        label = booked_as(self.phase)
        self.seconds[label] = self.seconds.get(label, 0.0) + (now - self.last)
        self.phase, self.last = phase, now
        return now

    def begin_step(self, step: int) -> None:
        self.step, self.microbatch, self.history, self.entries = step, 0, [], 0
        self.enter("step start")
        self.seconds = {}

    def take_seconds(self) -> dict[str, float]:
        """The step's seconds per phase so far (the current phase's included); booking goes on."""
        self._switch(self.phase)
        return dict(self.seconds)

    def leave(self, name: str) -> None:
        """A phase with an end of its own ended: the thread computes until the next one (progress too)."""
        self._switch(f"compute after {name}")

    def enter(self, name: str) -> None:
        now = self._switch(name)
        self.entries += 1
        if len(self.history) < 200:
            self.history.append((now, name))
        if name == "data wait":
            self.microbatch += 1
            if self._hang_at == (self.rank, self.step):  # the fault the watchdog's tests inject
                while True:
                    time.sleep(3600)
            if self._slow is not None and self._slow[0] == self.rank:  # the straggler report's tests
                time.sleep(self._slow[1])

    def nested(self, name: str) -> "_Nested":
        """``with PROGRESS.nested("reorder wait"): ...``: a phase inside the current one, which resumes after it."""
        return _Nested(self, name)


class _Nested:
    def __init__(self, progress: Progress, name: str):
        self.progress, self.name, self.outer = progress, name, None

    def __enter__(self):
        self.outer = self.progress.phase
        self.progress.enter(self.name)
        return self

    def __exit__(self, *exc):
        self.progress._switch(self.outer)
        return False


#: the process's progress (``train.profile.phase`` enters it)
PROGRESS = Progress()
