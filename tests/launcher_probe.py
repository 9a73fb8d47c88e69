"""A stand-in command for ``tests/test_preloaded.py``: each rank does what its arguments say, so the
launcher's exit codes, environment, cleanup and exit path can be checked against real torchrun's
without a training run. ``python -m launcher_probe WHAT [ARGS]`` from the tests folder."""

import atexit
import json
import os
import subprocess
import sys
import threading
import time


def _line(text: str) -> None:
    """One whole line in one write: ranks share stdout, and under ``PYTHONUNBUFFERED`` ``print`` writes the
    text and its newline separately, so two ranks' lines could interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _env(names: list[str]) -> None:
    """Print this rank's view: the named variables (``*`` for every torchrun one), cwd and sys.path[0]."""
    keys = [k for k in os.environ if k.startswith(("TORCHELASTIC_", "TORCH_NCCL")) or k in (
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")] + names
    _line(json.dumps({"env": {k: os.environ.get(k) for k in sorted(set(keys))}, "cwd": os.getcwd(),
                      "path0": sys.path[0], "argv0": os.path.basename(sys.argv[0])}))


def _fail(rank: int, fail_rank: int, code: int) -> None:
    if rank == fail_rank:
        print(f"rank {rank} fails with {code}", file=sys.stderr, flush=True)
        sys.exit(code)
    time.sleep(600)  # the launcher must stop this rank


def _hang(rank: int, folder: str) -> None:
    """Start a grandchild, note both pids, then hang until the launcher's timeout kills everything."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(folder, f"{rank}.pids"), "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def _all_reduce(rank: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    _line(json.dumps({"rank": rank, "sum": t.item()}))
    dist.destroy_process_group()


def _exit_path() -> None:
    """A non-daemon thread finishes before the atexit handlers run, as at an interpreter's exit."""
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    print("main done", flush=True)


def main(argv: list[str]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    what = argv[0]
    if what == "env":
        _env(argv[1:])
    elif what == "fail":
        _fail(rank, int(argv[1]), int(argv[2]))
    elif what == "raise":
        raise RuntimeError(f"probe failure on rank {rank}")
    elif what == "hang":
        _hang(rank, argv[1])
    elif what == "allreduce":
        _all_reduce(rank)
    elif what == "exit-path":
        _exit_path()
    else:
        raise SystemExit(f"unknown probe {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
