"""Writing a checkpoint's sharded parts: every rank writes what it owns, in parallel, now or in the
background, and the folder is published only once every rank's bytes are on disk.

Each part (``model/``, ``optimizer/``) goes through megatron's fully parallel save strategy
(``FullyParallelSaveStrategyWrapper`` over the torch-dist format): a tensor replicated over DP (or
over an encoder's TP ranks) is written by one of the ranks holding it, chosen to balance bytes, and a
distributed optimizer's shards (``dp_reshardable``, or ``--save-reshardable``'s boxes: :mod:`reshard`) are
written by their owners. No rank gathers anything but metadata.

One save is one megatron ``AsyncRequest`` (its parts' writes in one function, their finalizations
in order, then ours: the caller's ``publish``). Synchronous: run at once. ``--async-save``: the
tensors this rank writes are first copied into host memory the training process never writes
(:func:`stage`: a device-to-host copy on a GPU, a host copy on the CPU; the copy is the save's only
extra memory, at most the rank's own state), then megatron's writer runs on a background thread of
the training process (:class:`_WriterThread`, at the lowest CPU priority) while training goes on,
and :meth:`PendingSaves.poll` -- called by every rank once a step -- finalizes the save when every
rank's writer is done: megatron's metadata, then ``publish`` (``meta.json``, rename, ``latest``). A
run that ends waits for its pending save (:meth:`PendingSaves.wait`); a run killed before that
leaves the previous checkpoint ``latest`` (the writer dies with its process).

Why a thread and not megatron's forked writer: a fork shares the training process's pages
copy-on-write, so every page the next steps write (weights, Adam moments, the allocator's reused
heap) is copied in the fault handler while the writer lives -- measured on the CPU at 2.5x the step
time (``docs/benchmarks.md``). The writer's work is file I/O, torch's serialiser and fsync, which
run without the GIL for their bulk.

A write that fails on any rank (a full disk, say) fails the save on every rank with one line
(:class:`SaveFailed`, a ``UserError``), the unfinished ``.tmp`` folder removed and ``latest``
untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading

from mimo_sft.errors import UserError
from mimo_sft.train.checkpoint.files import latest_name

#: test hook: a background writer starts writing only after the next poll (the training step after the
#: save has updated every weight and moment), so a test sees whether the snapshot is the saved step's
HOLD_WRITER_ENV = "MIMO_SFT_TEST_HOLD_WRITER"
#: test hook: ``STEP`` (or ``STEP:RANK``) makes that step's save fail on that rank (every rank
#: without one) as a full disk would: a part file is started, then the write reports ENOSPC
ENOSPC_AT_ENV = "MIMO_SFT_TEST_ENOSPC_AT"


class SaveFailed(UserError):
    """A save that did not complete; the previous checkpoint stays ``latest``."""


def part_request(sharded_state_dict: dict, folder: str):
    """megatron's write of one dist-checkpoint part as an ``AsyncRequest`` (planned now: collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    return dist_checkpointing.save(sharded_state_dict, folder, strategy, async_sharded_save=True,
                                   async_strategy="mcore")


def one_request(parts: list, publish, *, step: int, background: bool = False):
    """The parts' writes as one request whose last finalization is ``publish`` (collective).

    The parts' tensors are staged for writing here, on the training thread: for a synchronous save
    megatron's preload (a device to host copy on a GPU, the tensors themselves on the CPU), for a
    ``background`` one :func:`stage` (host copies the training steps meanwhile never touch)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    writes = []
    for part in parts:
        if part.async_fn is None:  # nothing of this part is this rank's to write
            continue
        args = list(part.async_fn_args)
        if background:
            args[1] = stage(args[1])
        elif part.preload_fn is not None:
            args[1] = part.preload_fn()
        writes.append((part.async_fn, args, dict(part.async_fn_kwargs)))
    finalize = [fn for part in parts for fn in part.finalize_fns] + [publish]
    return AsyncRequest(_write_parts if writes else None, (writes, step), finalize)


def stage(write_buckets: list) -> list:
    """Every tensor of megatron's write buckets replaced, in place, by a copy of its own in host memory
    the training steps never touch: one anonymous mapping for the whole save, each tensor a slice of it
    with a storage of its own (torch saves a tensor's whole storage, so a view would write the rest).

    The same copy serves a device tensor (to host) and a host tensor (on the CPU the planned tensors are
    the live parameters and Adam moments the next step updates). One mapping, not an allocation per
    tensor: the copies stay out of the training process's heap, whose free memory the next steps
    reuse, and the mapping is returned to the system as a whole once the writes are done. In place, so
    each planned tensor megatron cloned itself (views of the flat buffers) is freed once copied: the
    peak is the bytes this rank writes plus one tensor."""
    import mmap

    import torch

    def padded(t) -> int:  # each slice starts 64-byte aligned
        return -(-t.numel() * t.element_size() // 64) * 64

    total = sum(padded(t) for _p, _k, (_b, ts) in write_buckets for _i, t in ts)
    if not total:
        return write_buckets
    arena = mmap.mmap(-1, total)
    offset = 0
    for _path, _key, (_bytes, tensors) in write_buckets:
        for i, (item, tensor) in enumerate(tensors):
            nbytes = tensor.numel() * tensor.element_size()
            raw = torch.frombuffer(arena, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
            copy = raw.view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor.detach())
            tensors[i] = (item, copy)
            offset += padded(tensor)
    return write_buckets


#: niceness of a background writer: training keeps the CPU it needs, the writer takes what is left
WRITER_NICENESS = 19
_hold = threading.Event()  # HOLD_WRITER_ENV: set by the poll after a save started


def _write_parts(writes: list, step: int) -> None:
    """Every part's write on this rank (with ``--async-save``: on the writer thread, at a lower CPU
    priority than the training thread; megatron's own write threads, started from it, inherit it)."""
    if threading.current_thread() is not threading.main_thread():
        _lower_priority()
        if os.environ.get(HOLD_WRITER_ENV):
            _hold.wait()
    for fn, args, kwargs in writes:
        if _enospc_injected(step):
            _fail_like_a_full_disk(args)
            continue
        fn(*args, **kwargs)


def _lower_priority() -> None:
    """This thread's niceness (Linux: per thread; elsewhere it would be the whole process's: left)."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)


def _enospc_injected(step: int) -> bool:
    want = os.environ.get(ENOSPC_AT_ENV)
    if not want:
        return False
    import torch.distributed as dist

    at_step, _, rank = want.partition(":")
    return int(at_step) == step and (not rank or int(rank) == dist.get_rank())


def _fail_like_a_full_disk(args: list) -> None:
    """What megatron's writer does when the disk fills: part of a file written, the error reported
    through its results queue (``args``: rank, write buckets, results queue)."""
    _rank, buckets, results = args
    path = buckets[0][0]
    with open(path, "wb") as fh:
        fh.write(b"\0" * 4096)
    results.put(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))


def run_now(request, *, tmp: str, root: str, step: int) -> None:
    """Write and publish now (every rank)."""
    with _failures_as_one_line(tmp=tmp, root=root, step=step):
        request.execute_sync()


class _WriterThread:
    """megatron's ``AsyncCaller`` contract (schedule, collective done-check, close) over a thread of
    the training process instead of a forked process (why: the module docstring)."""

    def __init__(self):
        self.thread: threading.Thread | None = None

    def schedule_async_call(self, request) -> None:
        if request.async_fn is None:
            return
        self.thread = threading.Thread(target=request.async_fn, args=request.async_fn_args,
                                       kwargs=request.async_fn_kwargs, name="mimo-sft-checkpoint-writer", daemon=True)
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether every rank's writer is done (one small all-reduce; ``blocking``: after joining ours)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller

        if blocking:
            self.close()
        alive = int(self.thread is not None and self.thread.is_alive())
        done = not alive if no_dist else bool(AsyncCaller.sync_all_async_calls(self, alive))
        if done:
            self.close()
        return done

    def close(self, abort: bool = False) -> None:
        if self.thread is not None and not abort:
            self.thread.join()
        self.thread = None


class PendingSaves:
    """The run's background saves (``--async-save``): at most one in flight."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        class _Queue(AsyncCallsQueue):  # megatron's queue and finalization order, our writer thread
            def _get_async_caller(self):
                return _WriterThread()

        self._queue = _Queue(persistent=False)
        self._current: dict | None = None

    @property
    def pending(self) -> bool:
        return self._current is not None

    def start(self, request, *, tmp: str, root: str, step: int) -> None:
        """Start ``request``'s writes in the background (every rank); a previous save is finished first."""
        self.wait()
        _hold.clear()
        self._queue.schedule_async_request(request)
        self._current = {"tmp": tmp, "root": root, "step": step}

    def poll(self) -> None:
        """Publish the pending save if every rank's writer is done. Collective (one small all-reduce)
        while a save is pending; free otherwise (every rank has the same saves pending)."""
        _hold.set()
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Finish and publish the pending save (every rank): before the next save and before the run ends."""
        _hold.set()
        self._finalize(blocking=True)

    def _finalize(self, *, blocking: bool) -> None:
        if self._current is None:
            return
        current = self._current
        try:
            with _failures_as_one_line(**current):
                self._queue.maybe_finalize_async_calls(blocking=blocking)
        finally:
            if not self._queue.get_num_unfinalized_calls():
                self._current = None


class _failures_as_one_line:
    """A failed write (torch's ``CheckpointException``, raised by megatron on every rank, or an ``OSError``) as
    one ``SaveFailed`` line on every rank; rank 0 removes the unfinished folder."""

    def __init__(self, *, tmp: str, root: str, step: int):
        self.tmp, self.root, self.step = tmp, root, step

    def __enter__(self):
        return self

    def __exit__(self, kind, err, _tb):
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from torch.distributed.checkpoint import CheckpointException

        if err is None or not isinstance(err, (CheckpointException, CheckpointingException, OSError)):
            return False
        import torch.distributed as dist

        reason = [_reason(err)]
        if isinstance(err, CheckpointException):  # raised on every rank; the failing ranks' errors are on rank 0
            dist.broadcast_object_list(reason, src=0)
        if dist.get_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        latest = latest_name(self.root)
        kept = f"{latest} stays the latest checkpoint" if latest else "no earlier checkpoint exists"
        raise SaveFailed(f"saving step {self.step} to {self.root} failed: {reason[0]}; {kept}") from None


def _reason(err: BaseException) -> str:
    text = _chain_text(err)
    if "No space left on device" in text or f"Errno {errno.ENOSPC}" in text:
        return ("the disk is full (No space left on device); free space there or point --save at a folder "
                "with room, then resume with --load-checkpoint")
    if isinstance(err, OSError):
        return f"{err.strerror or err} ({err.filename})" if err.filename else str(err)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"a rank could not write its part ({first[:200]})"


def _chain_text(err: BaseException) -> str:
    """The messages of an exception, its causes, and (torch's CheckpointException) the per-rank failures."""
    parts, seen = [], set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        parts.append(str(e))
        stack += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # rank -> (exception, traceback)
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return "\n".join(parts)
