"""The hang watchdog (``--hang-timeout``): a run that stops making progress says which rank stopped, where, and
exits with a code a scheduler can requeue on, before ``--dist-timeout`` fails every rank without a word.

How progress is seen: the training thread enters named phases (``mimo_sft.progress``: data wait, reorder wait,
bridge, gradient finalize, optimizer, evaluation, checkpoint save, and each module's forward and backward); each
entry is progress. A thread on every rank publishes this rank's step, phase, the time of its last progress, the
last collective the training thread entered (``parallel.collectives``: op, group, peers) and, in a data wait,
the loader worker it waits for (``data.loader_workers``) to the run's store (torchrun's TCP store; the world
group's) every few seconds. When a rank has made no progress for the timeout:

1. it writes ``OUTPUT_DIR/hang/rank_<r>.txt``: its step and micro-batch, its phase and since when, the phase
   history of the step, each thread's last collective, the loader worker a thread waits for, and every thread's
   Python stack (the training thread's shows the stuck frame);
2. the lowest rank whose heartbeat is fresh reads every rank's heartbeat and prints one line naming the ranks
   that are behind the others (an earlier step or phase), with the collective the others wait in that they never
   reached ("rank 1 (host) never reached batch_isend_irecv (to rank 1) on language pp (ranks 0,1) that rank(s) 0
   wait in; it is in data wait of step 2 ..."), or whose heartbeat stopped (a frozen or dead process);
3. every rank exits with :data:`HANG_EXIT_CODE` (75, ``EX_TEMPFAIL``: requeue it), the last checkpoint untouched.

The timeout: ``--hang-timeout`` seconds, or by default the larger of 10 minutes and 20 times the median step
(after 5 steps), never closer than a minute to ``--dist-timeout`` (check 1 refuses an explicit one that is not
shorter by 30 s). The watchdog is armed from step 1 (start-up has ``--dist-timeout`` alone), and the first step
(warm-up) is allowed the default's 10 minutes at least.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback

from mimo_sft.data.loader_workers import waiting_on
from mimo_sft.parallel.collectives import LAST, describe
from mimo_sft.progress import PROGRESS
from mimo_sft.train.elastic import record_error

#: the exit code of a run the watchdog ended (EX_TEMPFAIL): schedulers requeue on it (docs/troubleshooting.md)
HANG_EXIT_CODE = 75
#: the default timeout's floor, and how much shorter than ``--dist-timeout`` it stays
DEFAULT_HANG_S = 600.0
DIST_MARGIN_S = 60.0
#: test hook: ``RANK:STEP`` -- that rank stops in its data wait of that step (sleeps), as a stuck rank would
HANG_AT_ENV = "MIMO_SFT_TEST_HANG_AT"
_KEY = "mimo_sft/hb/"


def hang_timeout_s(setting: int, step_times: list[float], dist_timeout_s: float) -> float:
    """The timeout in force: ``setting`` when > 0, else the default (module docstring); ``inf`` when 0 (off)."""
    if setting == 0:
        return float("inf")
    if setting > 0:
        chosen = float(setting)
    else:
        median = statistics.median(step_times) if len(step_times) >= 5 else 0.0
        chosen = max(DEFAULT_HANG_S, 20 * median)
        chosen = min(chosen, max(dist_timeout_s - DIST_MARGIN_S, 1.0))
    if not step_times:  # the first step compiles, reads caches, fills loader workers
        chosen = max(chosen, min(DEFAULT_HANG_S, max(dist_timeout_s - DIST_MARGIN_S, 1.0)))
    return chosen


#: phases in which a rank waits on nobody: a rank stopped inside one of them holds the others up
LOCAL_PHASES = ("step start", "data wait", "optimizer", "checkpoint save", "evaluation")
#: phases in which the training thread may wait for a data-loader worker
DATA_PHASES = ("data wait", "reorder wait")


def _suspicion(phase: str) -> int:
    """2: inside a phase that waits on nobody; 1: computing (a module's forward or backward, or after a phase:
    perhaps in a collective no phase names, such as a parameter gather); 0: in a communicating phase (bridge,
    gradient finalize, reorder wait)."""
    if phase in LOCAL_PHASES:
        return 2
    return 1 if phase.startswith("compute after") or phase.endswith((" forward", " backward")) else 0


def behind(beats: dict[int, dict], now: float, timeout: float) -> tuple[list[int], list[int], dict | None]:
    """``(stuck ranks, silent ranks, a rank that waits for them)``. Silent ranks published nothing for the timeout
    (frozen or dead). Of the others, a rank at an earlier step than the rest is stuck; in the same step, the ranks
    of the most suspicious kind of phase (:func:`_suspicion`: inside their own data wait, optimizer or save, then
    computing, then communicating) are, when not every rank is of that kind: the rest wait for them. (Micro-batch
    counts are not compared: a language rank receives the encoder's output before it pulls its micro-batch.)
    Pure, tested without processes; each rank's dump is the ground truth."""
    silent = sorted(r for r, b in beats.items() if now - b["published"] > timeout)
    alive = {r: b for r, b in beats.items() if r not in silent}
    if not alive:
        return [], silent, None
    last = max(b["step"] for b in alive.values())
    stuck = [r for r, b in alive.items() if b["step"] < last]
    if not stuck:
        worst = max(_suspicion(b["phase"]) for b in alive.values())
        local = [r for r, b in alive.items() if _suspicion(b["phase"]) == worst]
        stuck = local if worst > 0 and len(local) < len(alive) else []
    waiting = [b for r, b in sorted(alive.items()) if r not in stuck]
    return sorted(stuck), silent, (waiting[0] if waiting and (stuck or silent) else None)


def _waited_in(r: int, waiting: list[int], beats: dict[int, dict]) -> tuple[str, list[int]] | None:
    """The collective that ranks of ``waiting`` are inside (or issued, when async) with rank ``r`` as a peer or a
    member of its group: ``(its text, those ranks)``, the one most of them wait in; None when none is."""
    by: dict[str, list[int]] = {}
    for w in waiting:
        c = beats[w].get("collective")
        if not c or c["state"] == "returned" or w == r:
            continue
        if r in ([rank for _, rank in c["peers"]] or c["ranks"]):
            by.setdefault(c["text"], []).append(w)
    return max(by.items(), key=lambda kv: len(kv[1])) if by else None


def _where(b: dict) -> str:
    """"data wait of step 2 (micro-batch 1)", with the loader worker it waits for and its last collective."""
    text = f"{b['phase']} of step {b['step']} (micro-batch {b['microbatch']})"
    if b.get("loader"):
        text += ": the data loader is stuck (" + "; ".join(b["loader"]) + ")"
    c = b.get("collective")
    return text + (f"; its last collective: {c['text']} ({c['state']})" if c else "")


def report_line(beats: dict[int, dict], now: float, timeout: float, world_size: int, folder: str) -> str:
    """The watchdog's one line (pure; tested without processes): each rank that stopped (:func:`behind`), the
    collective the others wait in that it never reached, where it is; then where the rest wait."""
    stuck, silent, _ = behind(beats, now, timeout)
    missing = sorted(set(range(world_size)) - set(beats))
    waiting = sorted(set(beats) - set(stuck) - set(silent))
    parts, named = [], set()
    for r in stuck + silent + missing:
        b = beats.get(r)
        who = f"rank {r} ({b['host']})" if b else f"rank {r}"
        wait = _waited_in(r, waiting, beats)
        if wait:
            named |= set(wait[1])
            who += f" never reached {wait[0]} that rank(s) {','.join(map(str, wait[1]))} wait in;"
        if r in stuck:
            parts.append(f"{who} it is in {_where(b)}" if wait else f"{who} is in {_where(b)}")
        else:
            parts.append(f"{who} stopped publishing (frozen or dead)")
    rest = [r for r in waiting if r not in named]
    if rest and parts:
        by: dict[str, list[int]] = {}
        for r in rest:
            b, c = beats[r], beats[r].get("collective")
            inside = f" ({c['text']}, {c['state']})" if c and c["state"] != "returned" else ""
            by.setdefault(f"{b['phase']} of step {b['step']}{inside}", []).append(r)
        parts += [f"rank(s) {','.join(map(str, rs))} wait for them in {where}" for where, rs in by.items()]
    elif not parts:
        inflight = {}
        for r, b in sorted(beats.items()):
            c = b.get("collective")
            inflight.setdefault(c["text"] if c and c["state"] != "returned" else b["phase"], []).append(r)
        parts.append("every rank is at the same point (a collective or I/O that never ends): " + "; ".join(
            f"rank(s) {','.join(map(str, rs))} in {what}" for what, rs in inflight.items()))
    return (f"error: hang: no progress for {timeout:.0f} s: {'; '.join(parts)}. Stacks of every rank in {folder}/; "
            f"exiting with {HANG_EXIT_CODE} (requeue: resume from the last checkpoint)")


class Watchdog:
    """One rank's watchdog thread (module docstring). ``store``: the world group's store (None: single process)."""

    def __init__(self, *, output_dir: str, rank: int, world_size: int, store, setting: int, dist_timeout_s: float,
                 poll_s: float | None = None):
        self.output_dir, self.rank, self.world_size, self.store = output_dir, rank, world_size, store
        self.setting, self.dist_timeout_s = setting, dist_timeout_s
        self.step_times: list[float] = []
        self.host = socket.gethostname()
        self.train_thread = threading.get_ident()  # the watchdog starts on the training thread
        PROGRESS.rank = rank
        hook = os.environ.get(HANG_AT_ENV)
        if hook:
            r, s = hook.split(":")
            PROGRESS._hang_at = (int(r), int(s))
        self._stop = threading.Event()
        self.poll_s = poll_s or 2.0
        self._thread = None
        if setting != 0:
            self._thread = threading.Thread(target=self._loop, name="mimo-sft-watchdog", daemon=True)
            self._thread.start()

    def step_done(self, step_time_s: float) -> None:
        self.step_times.append(step_time_s)
        del self.step_times[:-50]

    @property
    def timeout_s(self) -> float:
        return hang_timeout_s(self.setting, self.step_times, self.dist_timeout_s)

    def close(self) -> None:
        self._stop.set()

    # ---- the thread ---------------------------------------------------------------------------------------
    def _beat(self) -> dict:
        p = PROGRESS
        # in a data wait: the loader worker a thread waits for (a stack walk; only there, every few seconds)
        loader = [w["text"] for w in waiting_on()] if p.phase in DATA_PHASES else []
        return {"rank": self.rank, "host": self.host, "step": p.step, "microbatch": p.microbatch, "phase": p.phase,
                "entries": p.entries, "idle_s": round(time.monotonic() - p.last, 1), "published": time.time(),
                "collective": describe(LAST.get(self.train_thread)), "loader": loader}

    def _publish(self) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{_KEY}{self.rank}", json.dumps(self._beat()))
            except Exception:  # noqa: BLE001 - a store that is gone (the run is ending) is not the watchdog's news
                pass

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._publish()
            # armed from step 1: start-up (a file check, a resume's reads) has --dist-timeout alone
            if PROGRESS.step >= 1 and time.monotonic() - PROGRESS.last > self.timeout_s:
                self._hang()
                return

    def _read_beats(self) -> dict[int, dict]:
        beats = {}
        for r in range(self.world_size):
            try:
                if self.store.check([f"{_KEY}{r}"]):
                    beats[r] = json.loads(self.store.get(f"{_KEY}{r}"))
            except Exception:  # noqa: BLE001 - unreadable: treated as silent
                continue
        return beats

    def _hang(self) -> None:
        timeout = self.timeout_s
        path = self.dump(timeout)
        if self.store is not None:
            self.store.set(f"mimo_sft/hang/dumped/{self.rank}", "1")
            time.sleep(min(10.0, 3 * self.poll_s))  # the others see their own timeout within a poll or two
            beats = self._read_beats()
            fresh = [r for r, b in beats.items() if time.time() - b["published"] <= timeout]
            if not fresh or self.rank == min(fresh):
                line = self.report(beats, timeout)
                if not record_error(self.rank, line, HANG_EXIT_CODE):  # mimo-sft's launcher prints it, else here
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
                self.store.set("mimo_sft/hang/reported", "1")
            else:  # the reporter prints; leaving first would let torchrun stop it before it does
                deadline = time.monotonic() + 30.0
                while time.monotonic() < deadline and not self.store.check(["mimo_sft/hang/reported"]):
                    time.sleep(0.5)
        else:
            line = f"error: hang: no progress for {timeout:.0f} s in {_where(self._beat())}; stack in {path}"
            if not record_error(self.rank, line, HANG_EXIT_CODE):
                sys.stderr.write(line + "\n")
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)

    def report(self, beats: dict[int, dict], timeout: float) -> str:
        """The one line naming the ranks that stopped (:func:`report_line`)."""
        return report_line(beats, time.time(), timeout, self.world_size, os.path.join(self.output_dir, "hang"))

    def dump(self, timeout: float) -> str:
        """``OUTPUT_DIR/hang/rank_<r>.txt``: where this rank is, and every thread's stack."""
        folder = os.path.join(self.output_dir, "hang")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank_{self.rank}.txt")
        p = PROGRESS
        now = time.monotonic()
        lines = [f"rank {self.rank} on {self.host}: no progress for {now - p.last:.1f} s (timeout {timeout:.0f} s)",
                 f"step {p.step}, micro-batch {p.microbatch}, phase: {p.phase}",
                 "this step's phases (seconds before now):"]
        lines += [f"  {now - t:9.1f}  {name}" for t, name in p.history[-30:]]
        names = {t.ident: t.name for t in threading.enumerate()}
        lines.append("last collective entered, per thread (state: in = inside it, returned, issued = async):")
        for ident, slot in sorted(dict(LAST).items(), key=lambda kv: kv[1][0]):
            c = describe(slot)
            lines.append(f"  {names.get(ident, ident)}: #{c['seq']} {c['text']}, {c['state']}")
        lines += [f"data loader: {w['text']}" for w in waiting_on()]
        frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != self.train_thread)  # training first
        for ident, frame in frames:
            lines.append(f"\n--- thread {names.get(ident, ident)} ---")
            lines += [ln.rstrip("\n") for ln in traceback.format_stack(frame)]
        with open(path, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        return path


def start_watchdog(cfg, output_dir: str, rank: int) -> Watchdog:
    """This rank's watchdog for the run of ``cfg`` (its thread runs unless ``--hang-timeout 0``), publishing to the
    world group's store."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (RuntimeError, ValueError):
        store = None
    setting = -1 if cfg.train.hang_timeout_s is None else int(cfg.train.hang_timeout_s)
    return Watchdog(output_dir=output_dir, rank=rank, world_size=world, store=store, setting=setting,
                    dist_timeout_s=float(cfg.train.dist_timeout_s))
