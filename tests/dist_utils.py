"""Run a test body in N real gloo processes (torch.multiprocessing spawn, localhost rendezvous).

Each worker initialises torch.distributed the way ``finetune`` does (``bootstrap.start_world``: device
choice, then the process group; gloo on these CPU machines), runs ``fn(rank, world, *args)`` and reports
its return value (or its traceback) to the parent, which fails the test with the first error.
"""

from __future__ import annotations

import os
import random
import socket
import traceback

import torch.multiprocessing as mp


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


def _worker(rank, world, port, fn, args, queue):
    import torch.distributed as dist

    from mimo_sft.parallel.bootstrap import start_world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        start_world(timeout_s=120)
        out = fn(rank, world, *args)
        queue.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, then let the parent fail the test
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world: int, *args, timeout: float = 240.0) -> list:
    """Run ``fn`` on ``world`` gloo ranks; return the per-rank results in rank order."""
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
