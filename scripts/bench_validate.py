"""Time `mimo-sft validate` on large layouts, as a user runs it (a fresh process each time).

    .venv/bin/python scripts/bench_validate.py

Prints a table: world size, layout, wall seconds and CPU seconds (user + system; median of 3 runs of the whole
CLI process). On a shared machine the wall time follows the load; the CPU time barely does.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time

LAYOUTS = [
    (8, ["language=tp=1,dp=4,rank_offset=0", "images=dp=4,rank_offset=4"], 8),
    (1024, ["language=tp=8,pp=4,dp=16,rank_offset=0", "images=tp=1,dp=16,pp=1,rank_offset=512"], 64),
    (1024, ["language=tp=1,pp=1,dp=512,rank_offset=0", "images=tp=1,dp=512,rank_offset=512"], 512),
    (1024, ["language=tp=8,pp=1,dp=128", "images=tp=1,dp=1024"], 1024),
]


def run(components, mbs, world):
    args = [sys.executable, "-m", "mimo_sft", "validate", "--quiet", "--micro-batch-size", str(mbs),
            "--global-batch-size", str(mbs * 2), "--scalable-dp"]
    for c in components:
        args += ["--component", c]
    times, cpus = [], []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    verdict = "VALID" if proc.returncode == 0 else "INVALID"
    return statistics.median(times), statistics.median(cpus), verdict


def main():
    print("| world | layout | verdict | validate wall time (s, median of 3) | CPU time (s, median of 3) |")
    print("|---|---|---|---|---|")
    for world, comps, mbs in LAYOUTS:
        secs, cpu, verdict = run(comps, mbs, world)
        print(f"| {world} | {' '.join(comps)} | {verdict} | {secs:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
