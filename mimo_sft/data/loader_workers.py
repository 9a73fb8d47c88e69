"""Which DataLoader worker a rank waits for, or lost: the data side of the hang watchdog's report.

Two ways a loader worker stops a run:

* it dies (the kernel's out-of-memory killer, a crash in a decoder): torch notices in the process that reads from
  it, and raises ``RuntimeError("DataLoader worker (pid N) ...")`` there: in the training thread, or in the
  reorder / index-planning thread, which hands it on to the training thread. :func:`worker_failure` turns that
  error into one line naming the worker and how it ended (``train.launch`` prints it and exits 1: a rerun would
  meet the same sample or the same memory limit, so it is not the watchdog's requeue code);
* it stalls (a read on a dead file system, a decoder that never returns): the reading thread waits for it
  forever (mimo-sft sets no loader timeout: a slow shared file system is not an error). The watchdog sees a
  rank with no progress in its data wait; :func:`waiting_on` names the worker that thread waits for, read from
  the thread's stack: the loader iterator torch is waiting in, the index of the item it expects, and the worker
  torch sent that item to.

Both read torch's multi-process loader iterator's private fields (``_workers``, ``_task_info``, ``_rcvd_idx``);
where they are missing (another torch) the line says less, never fails.
"""

from __future__ import annotations

import gc
import re
import signal
import sys
import threading

_WORKER_PIDS = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")
#: torch's functions, in torch/utils/data/dataloader.py, that a thread reading from a loader waits in
_WAIT_FRAMES = ("_try_get_data", "_get_data", "_next_data")


def _iterator_type():
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    return _MultiProcessingDataLoaderIter


def _what(it) -> str:
    """"the DataLoader over MicroBatchDataset": which loader (a rank has a micro-batch one, maybe a cost one)."""
    return f"the DataLoader over {type(getattr(it, '_dataset', None)).__name__}"


def waiting_on(frames: dict | None = None) -> list[dict]:
    """For each thread waiting inside a multi-process DataLoader iterator: ``thread``, ``worker`` (the worker
    torch sent the awaited item to, None if unknown), ``pid``, ``alive``, ``loader`` and ``text``.
    ``frames``: ``sys._current_frames()`` (default: now)."""
    kind = _iterator_type()
    names = {t.ident: t.name for t in threading.enumerate()}
    found = []
    for ident, frame in (sys._current_frames() if frames is None else frames).items():
        f = frame
        while f is not None:
            it = f.f_locals.get("self") if f.f_code.co_name in _WAIT_FRAMES else None
            if isinstance(it, kind):
                found.append(_waiting(names.get(ident, str(ident)), it))
                break
            f = f.f_back
    return found


def _waiting(thread: str, it) -> dict:
    worker = pid = alive = None
    try:
        info = it._task_info.get(it._rcvd_idx)
        if info is not None and len(info) == 1:  # sent to that worker, not yet received
            worker = int(info[0])
            proc = it._workers[worker]
            pid, alive = proc.pid, proc.is_alive()
    except (AttributeError, IndexError, TypeError):
        pass
    if worker is None:
        text = f"{thread} waits for {_what(it)} (which worker is not known)"
    else:
        state = "alive, not delivering" if alive else "dead"
        text = f"{thread} waits for worker {worker} (pid {pid}, {state}) of {_what(it)}"
    return {"thread": thread, "worker": worker, "pid": pid, "alive": alive, "loader": _what(it), "text": text}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _iterators_of(exc: BaseException) -> list:
    """The loader iterators in the frames ``exc`` passed through, else every live one in the process."""
    kind = _iterator_type()
    found = []
    for e in _chain(exc):
        tb = e.__traceback__
        while tb is not None:
            it = tb.tb_frame.f_locals.get("self")
            if isinstance(it, kind) and it not in found:
                found.append(it)
            tb = tb.tb_next
    return found or [o for o in gc.get_objects() if issubclass(type(o), kind)]  # type(): no proxy __class__


def _how(exitcode) -> str:
    if exitcode is None:
        return "exited"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = (" (the kernel's out-of-memory killer sends it: check `dmesg` and the node's memory, lower "
                "--num-workers)") if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"


def worker_failure(exc: BaseException) -> str | None:
    """One line for an error that says a DataLoader worker died (None: ``exc`` says nothing of the kind):
    which worker of which loader, its pid, and how it ended."""
    pids = None
    for e in _chain(exc):
        m = _WORKER_PIDS.search(str(e)) if isinstance(e, RuntimeError) else None
        if m:
            pids = [int(p) for p in m.group(1).replace(",", " ").split()]
            break
    if pids is None:
        return None
    parts = []
    for pid in pids:
        part = f"a DataLoader worker (pid {pid}) died"
        for it in _iterators_of(exc):
            procs = list(getattr(it, "_workers", ()))
            hit = next((i for i, p in enumerate(procs) if p.pid == pid), None)
            if hit is not None:
                part = f"worker {hit} (pid {pid}) of {_what(it)} {_how(procs[hit].exitcode)}"
                break
        parts.append(part)
    return "data loader: " + "; ".join(parts) + "; the run stops (restart it from the last checkpoint)"
