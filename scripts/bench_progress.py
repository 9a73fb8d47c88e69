#!/usr/bin/env python
"""What the hang watchdog's progress and the straggler report cost per step (issue 45); results go to
docs/benchmarks.md ("The hang watchdog's and the straggler report's cost").

  (a) per phase entry and exit: ``record_function`` alone (the profiler's range, entered anyway) against
      ``train.profile.phase`` (the range, the watchdog's progress and the seconds booked per phase);
  (b) per micro-batch: a small two-module forward and backward with and without the module-phase hooks the
      trainer installs for the whole run (``train.profile.ModulePhases``);
  (c) per log step, on the metrics rank: the straggler report's bookkeeping and analysis of a world of N ranks
      (``train.straggler.StragglerReport``: add, figures, analyse), and the bytes its block adds to the
      model-FLOPs all-reduce;
  (d) that all-reduce over 4 gloo processes on this machine: the step's 4 figures alone, and with the block of a
      4-rank and of a 1024-rank world (the payload; the ranks are 4);
  (e) the collective recorder (``parallel.collectives``) per call: around a function that does nothing (its whole
      cost), and around a real 1-rank gloo all_reduce of 4 floats, against the unwrapped function.

Usage: python scripts/bench_progress.py [--reps 200000]
Timings are the best of 7 repetitions (the machine is shared). CPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.autograd.profiler import record_function  # noqa: E402

from mimo_sft.parallel.components import parse_component  # noqa: E402
from mimo_sft.parallel.layout import Layout  # noqa: E402
from mimo_sft.progress import PROGRESS  # noqa: E402
from mimo_sft.train.profile import ModulePhases, phase  # noqa: E402
from mimo_sft.train.straggler import ROW, StragglerReport  # noqa: E402


def best(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def phases(reps: int) -> list[tuple[str, float]]:
    def bare():
        for _ in range(reps):
            with record_function("x"):
                pass

    def ours():
        PROGRESS.begin_step(1)
        for _ in range(reps):
            with phase("optimizer"):
                pass

    return [("`record_function` alone", best(bare) / reps), ("`phase` (range + progress + seconds booked)",
                                                             best(ours) / reps)]


def hooks(reps: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    encoder, language = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)

    def step():
        for _ in range(reps):
            language(encoder(x)).sum().backward()

    plain = best(step) / reps
    installed = ModulePhases({"encoder": encoder, "language": language})
    PROGRESS.begin_step(1)
    hooked = best(step) / reps
    installed.remove()
    return [("forward + backward, no hooks", plain), ("with the module-phase hooks", hooked)]


def report(world: int, reps: int) -> tuple[float, int]:
    """Seconds per log step of add + figures (every rank) and analyse (the metrics rank) at ``world`` ranks, and
    the bytes its figures add to a metrics.jsonl row."""
    half = world // 2
    layout = Layout.from_specs([parse_component(f"language=dp={half}"),
                                parse_component(f"images=dp={world - half},rank_offset={half}")])
    rep = StragglerReport(rank=0, world_size=world, layout=layout, log_interval=1, total_steps=10 ** 9,
                          threshold=1.5, hosts=[f"n{r // 8}" for r in range(world)])
    seconds = {"data wait": 0.01, "encoder forward": 0.1, "bridge": 0.05, "optimizer": 0.02, "compute": 0.01}
    block = [0.1 + 0.01 * (i % 97) for i in range(world * ROW)]  # varied: some ranks above the threshold

    def once():
        with contextlib.redirect_stdout(io.StringIO()):
            for step in range(1, reps + 1):
                rep.add(0.2, seconds)
                rep.figures(step)
                rep.analyse(step, block)

    row = json.dumps(rep.analyse(1, block))
    return best(once, 3) / reps, len(row)


def _allreduce(rank: int, world: int, port: int, sizes: list[int], reps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    for n in sizes:
        t = torch.zeros(n, dtype=torch.float64)
        for _ in range(20):
            dist.all_reduce(t)

        def run():
            for _ in range(reps):
                dist.all_reduce(t)

        dist.barrier()
        result[n] = best(run, 3) / reps
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def allreduce(reps: int) -> dict[int, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = [4, 4 + 4 * ROW, 4 + 1024 * ROW]
    procs = [ctx.Process(target=_allreduce, args=(r, 4, port, sizes, reps, q)) for r in range(4)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join()
    return result


def recorder(reps: int) -> list[tuple[str, float]]:
    from mimo_sft.parallel import collectives

    def nothing(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = collectives._recording("all_reduce", nothing, None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    collectives.install()
    t = torch.zeros(4)
    rows = []
    for name, bare, rec, n in (("a function that does nothing", nothing, wrapped, reps),
                               ("a 1-rank gloo all_reduce, 4 floats", dist.all_reduce.__wrapped__, dist.all_reduce,
                                reps // 20)):
        times = {bare: [], rec: []}
        for _ in range(9):  # alternated, so that a burst of load on the shared machine hits both alike
            for fn in (bare, rec):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn(t, group=None)
                times[fn].append((time.perf_counter() - t0) / n)
        rows.append((name, min(times[bare]), min(times[rec])))
    dist.destroy_process_group()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=200_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"(a) per phase entry and exit, {args.reps} times")
    print("| | per phase |\n|---|---|")
    for name, s in phases(args.reps):
        print(f"| {name} | {s * 1e6:.2f} us |")
    n = max(args.reps // 100, 200)
    print(f"\n(b) per micro-batch: two Linear(64, 64) modules, batch 8, forward + backward, {n} times")
    print("| | per micro-batch |\n|---|---|")
    for name, s in hooks(n):
        print(f"| {name} | {s * 1e6:.1f} us |")
    print("\n(c) the straggler report per log step on the metrics rank (every rank: add + figures; metrics rank: "
          "analyse)")
    print("| ranks | per log step | block in the all-reduce | metrics.jsonl row grows by |\n|---|---|---|---|")
    for world in (8, 64, 256, 1024):
        seconds, size = report(world, max(10, 20_000 // world))
        print(f"| {world} | {seconds * 1e3:.3f} ms | {world * ROW * 8 / 1024:.1f} KiB | {size / 1024:.1f} KiB |")
    print("\n(d) the model-FLOPs all-reduce over 4 gloo processes on this machine")
    print("| payload | per all-reduce |\n|---|---|")
    names = {4: "the step's 4 figures (every step)", 4 + 4 * ROW: "+ the block of 4 ranks (log steps)",
             4 + 1024 * ROW: "+ the block of 1024 ranks (log steps)"}
    for size, s in allreduce(200).items():
        print(f"| {names[size]}: {size * 8} B | {s * 1e6:.0f} us |")
    print(f"\n(e) the collective recorder per call, {args.reps} calls (a real all_reduce: 1/20 of them)")
    print("| around | unwrapped | recorded | the recorder's cost |\n|---|---|---|---|")
    for name, bare, rec in recorder(args.reps):
        print(f"| {name} | {bare * 1e9:.0f} ns | {rec * 1e9:.0f} ns | {(rec - bare) * 1e9:.0f} ns |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
