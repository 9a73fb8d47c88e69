"""Run a test body in N real gloo processes (localhost rendezvous).

Each worker initialises torch.distributed the way ``finetune`` does (``bootstrap.start_world``: device
choice, then the process group; gloo on these CPU machines), runs ``fn(rank, world, *args)`` and reports
its return value (or its traceback) to the parent, which fails the test with the first error. A ``fn`` with
``on_standin_device = True`` runs on the device audit's stand-in device instead of the CPU.

The workers are forked from the preloaded parent of ``tests/preloaded.py`` (torch, megatron-core,
transformers and mimo_sft already imported; ``fn`` and its arguments are pickled and ``fn``'s module is
imported by name, as spawn does); ``real=True``, or an environment the preloaded parent cannot stand in
for, uses torch.multiprocessing's spawn.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import socket
import tempfile
import traceback

import preloaded

#: ports handed out below Linux's ephemeral range (32768-60999): gloo's and every other connection's
#: own sockets take ephemeral ports, so a port picked there could be taken again before torchrun
#: binds it (seen once in CI: EADDRINUSE at rendezvous, with another test running beside it)
PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A free localhost port (the one copy for the tests: spawned workers and torchrun's --master-port)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def _run_rank(rank, world, port, fn, args) -> tuple[str, object]:
    """One worker's body: its world, ``fn``, then a barrier so that no rank leaves the group early."""
    import torch.distributed as dist

    from mimo_sft.parallel.bootstrap import start_world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    if getattr(fn, "on_standin_device", False):  # the device audit's stand-in (mimo_sft.testing.device_audit)
        from mimo_sft.parallel import runtime
        from mimo_sft.testing.device_audit import STANDIN_DEVICE

        runtime.use_device(STANDIN_DEVICE)
    start_world(timeout_s=120)
    out = fn(rank, world, *args)
    return out, dist


def _worker(rank, world, port, fn, args, queue):
    """A spawned worker: the result (or the traceback) goes to the parent's queue."""
    try:
        out, dist = _run_rank(rank, world, port, fn, args)
        queue.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, then let the parent fail the test
        queue.put((rank, "error", traceback.format_exc()))


def _forked_worker(rank, world, port, fn, args, result_dir):
    """A forked worker: the result (or the traceback) goes to ``result_dir/RANK.pkl``; a failed rank
    exits 1, so that the supervisor stops the others at once."""
    try:
        out, dist = _run_rank(rank, world, port, fn, args)
        _write_result(result_dir, rank, ("ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        _write_result(result_dir, rank, ("error", traceback.format_exc()))
        raise SystemExit(1)


def _write_result(result_dir: str, rank: int, result: tuple) -> None:
    path = os.path.join(result_dir, f"{rank}.pkl")
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(path + ".tmp", path)


def run_distributed(fn, world: int, *args, timeout: float = 240.0, real: bool = False) -> list:
    """Run ``fn`` on ``world`` gloo ranks; return the per-rank results in rank order."""
    zygote = None if real else preloaded.usable(dict(os.environ))
    if zygote is None:
        return _run_spawned(fn, world, args, timeout)
    result_dir = tempfile.mkdtemp(prefix="mimo_sft_dist_")
    try:
        code, codes = preloaded.run_call(zygote, world, _forked_worker, (world, free_port(), fn, args, result_dir),
                                         timeout=timeout)
        results, errors = {}, []
        for rank in range(world):
            path = os.path.join(result_dir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    status, value = pickle.load(fh)
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
                else:
                    results[rank] = value
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)
    if code is None:
        errors.append(f"timed out after {timeout} s (ranks that reported: {sorted(results)})")
    elif not errors and len(results) < world:
        errors.append(f"ranks exited without a result: exit codes {codes}")
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def _run_spawned(fn, world: int, args: tuple, timeout: float) -> list:
    """The fresh-interpreter way (torch.multiprocessing spawn), for ``real=True`` and as the fallback."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
