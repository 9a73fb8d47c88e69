#!/usr/bin/env python
"""Context parallelism at real width, on the CPU: autograd's saved bytes per rank and the step time of a decoder
block on one packed row, at cp 1, 2 and 4 (the table in docs/benchmarks.md).

    python scripts/bench_cp.py [--preset qwen2.5-vl-7b] [--tokens 32768] [--docs 4] [--layers 2] [--dtype bf16] [--cp 1,2,4]

For each cp, ``cp`` gloo processes build ``--layers`` decoder layers of the preset as training builds them
(our config, spec and SDPA core, weights as allocated: what is saved depends on shapes, not values) and run
one packed row of ``--tokens`` positions in ``--docs`` equal documents, each rank its zigzag share
(``model.context_parallel``: the Ulysses all-to-all around the segment attention, megatron's THD rotary on the
whole row's angles). Printed per cp: the bytes autograd saves for backward on one rank (``testing.cp_measure``:
distinct storages, parameters and the shared rotary table left out), their ratio to cp 1, and one forward +
backward's wall time (the slowest rank). Attention runs on torch's flash SDPA kernel, the one GPUs use.

The processes share this machine's cores: at cp 4 on 2 cores, four ranks take turns, so the step time measures
the work per rank and the exchange, not a speed-up a GPU per rank would see.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024 ** 3


def _worker(rank, world, port, hf_dir, lengths, layers, dtype_name, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    from mimo_sft.parallel.bootstrap import start_world
    from mimo_sft.testing.cp_measure import measure

    start_world(timeout_s=3600)
    out = measure(hf_dir, lengths, dtype=getattr(torch, dtype_name), num_layers=layers)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run_cp(cp: int, hf_dir: str, lengths: list[int], layers: int, dtype_name: str) -> list[dict]:
    """One world of ``cp`` spawned ranks; each rank's measurement, in rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, hf_dir, lengths, layers, dtype_name, queue))
             for r in range(cp)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=7200) for _ in range(cp))
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(cp)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-vl-7b")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--docs", type=int, default=4, help="equal documents in the packed row")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--cp", default="1,2,4")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from mimo_sft.testing.tiny_checkpoint import preset_config

    cps = [int(c) for c in a.cp.split(",")]
    unit = 2 * max(cps) * a.docs
    tokens = a.tokens // unit * unit  # every document splits into 2*cp chunks at every cp
    lengths = [tokens // a.docs] * a.docs
    dtype_name = {"bf16": "bfloat16", "fp32": "float32"}[a.dtype]
    print(f"{a.preset}, {a.layers} decoder layers, {a.dtype}: one packed row of {tokens:,} tokens "
          f"({a.docs} documents of {lengths[0]:,}), cp ranks as gloo processes on {os.cpu_count()} CPU cores")
    print(f"{'cp':>3} | {'saved per rank (GiB)':>21} | {'x cp 1':>7} | {'per token (KiB)':>15} | {'step (s)':>9}")
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        preset_config(a.preset).save_pretrained(tmp)
        for cp in cps:
            ranks = run_cp(cp, tmp, lengths, a.layers, dtype_name)
            saved = max(r["saved_bytes"] for r in ranks)
            first = first or (saved if cp == 1 else None)
            ratio = f"{saved / first:.3f}" if first else "-"
            print(f"{cp:>3} | {saved / GIB:>21.3f} | {ratio:>7} | {saved / (tokens / cp) / 1024:>15.1f} | "
                  f"{ranks[0]['step_s']:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
