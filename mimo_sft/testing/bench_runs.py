"""What the benchmark scripts share: the environment of a benchmark run and a torchrun launcher.

Why a launcher: megatron's checkpoint writer processes can outlive torchrun and keep its output
pipe open, so ``subprocess.run(capture_output=True)`` may never return. Each run gets its own
session with output to a log file, and the session is ended when torchrun exits.
"""

from __future__ import annotations

import os
import signal
import subprocess


def bench_env() -> dict:
    """One thread per process, offline hubs, quiet progress bars and warnings."""
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                HF_DATASETS_DISABLE_PROGRESS_BARS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def run_session(cmd: list[str], *, cwd: str, env: dict, log: str) -> None:
    """Run ``cmd`` in its own session with output to ``log``; SystemExit with the log's tail on failure."""
    with open(log, "w") as fh:
        child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        code = child.wait()
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}\n{open(log).read()[-3000:]}")
