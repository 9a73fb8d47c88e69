"""Where a run's start-up went: seconds from the process's start to step 1, by part.

Why: the first GPU run spent 135 s before its first step and nothing said where. The trainer times each part of
its set-up with :class:`StartupClock` and says it once, in one banner line (:meth:`StartupClock.line`), and in
the ``startup_*`` keys of the first ``metrics.jsonl`` row it writes (:meth:`StartupClock.metrics`).

The clock starts when the process did (the kernel's record of it, so the interpreter's start and every import
before the trainer count, under torchrun or not); ``imports`` is that time up to the trainer's set-up (the
interpreter, the imports, the config load and checks). Parts do not overlap, and a part inside another is
taken out of it (the optimizer inside the model build), so the parts never add up to more than the total;
what no part names (the watchdog, the runner, the logger, the validation set's checks) is in the total only.
"""

from __future__ import annotations

import contextlib
import os
import time

#: the parts, in the order the set-up runs them (each is a ``startup_<part>_s`` key)
PARTS = ("imports", "groups", "model", "optimizer", "resume", "data", "first_batch")


def process_start_time() -> float:
    """This process's start, in ``time.time()`` seconds (the kernel's record: 10 ms resolution on Linux)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # noqa: BLE001 - no record to read: count from the first call instead
        return time.time()


class StartupClock:
    """Seconds per start-up part (:data:`PARTS`) since the process started; see the module docstring."""

    def __init__(self, start: float | None = None):
        self.start = process_start_time() if start is None else start
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.seconds["imports"] = max(0.0, time.time() - self.start)
        self.end: float | None = None
        self._open: list[list[float]] = []  # per open part: [its start, seconds of the parts inside it]

    @contextlib.contextmanager
    def part(self, name: str):
        """Time the block as part ``name`` (less the parts timed inside it)."""
        assert name in PARTS, name
        entry = [time.time(), 0.0]
        self._open.append(entry)
        try:
            yield
        finally:
            self._open.pop()
            took = max(0.0, time.time() - entry[0])
            self.seconds[name] += max(0.0, took - entry[1])
            if self._open:
                self._open[-1][1] += took

    def stop(self) -> float:
        """End the start-up (step 1 starts next); its total seconds."""
        self.end = time.time()
        return self.total

    @property
    def total(self) -> float:
        return max(0.0, (self.end if self.end is not None else time.time()) - self.start)

    def metrics(self) -> dict:
        """``startup_s`` and ``startup_<part>_s``: the keys the first metrics row carries."""
        return {"startup_s": round(self.total, 3), **{f"startup_{k}_s": round(v, 3) for k, v in self.seconds.items()}}

    @staticmethod
    def line_of(figures: dict) -> str:
        """The banner line for :meth:`metrics`' figures (a resume's part only when there was one)."""
        parts = [f"{k.replace('_', ' ')} {figures[f'startup_{k}_s']:.1f}" for k in PARTS
                 if k != "resume" or figures[f"startup_{k}_s"] > 0]
        return f"start-up {figures['startup_s']:.1f} s ({', '.join(parts)})"

    def line(self) -> str:
        return self.line_of(self.metrics())


def slowest(figures: list[dict]) -> tuple[int, dict]:
    """``(rank, figures)`` of the rank whose start-up took longest (every rank's :meth:`StartupClock.metrics`)."""
    rank = max(range(len(figures)), key=lambda r: figures[r]["startup_s"])
    return rank, figures[rank]
