"""scripts/slurm/finetune.sbatch (issue 45 item 4) without a cluster: it parses (``bash -n``); its dry run prints
each node's command, which mimo-sft's launcher and config loader accept as they are; run with stand-ins for
``srun`` and ``scontrol`` on PATH, each node gets its own ``--node-rank``, and the job is requeued on the watchdog's
exit code and after the time-limit signal, not after a finished or failed run. And the launcher's side of that
signal: a SIGUSR1 to it reaches every worker that left its pid."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mimo_sft.train.watchdog import HANG_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "finetune.sbatch"

FAKE_SCONTROL = """#!/bin/bash
# stand-in for scontrol: the allocation's host names, and a record of requeues
case "$1" in
  show) printf 'gpu07\\ngpu08\\n' ;;
  requeue) echo "requeue $2" >> "$FAKE_LOG" ;;
esac
"""
FAKE_SRUN = """#!/bin/bash
# stand-in for srun: its options recorded and dropped, the task run as node 0 and node 1, then its exit code
echo "srun $*" >> "$FAKE_LOG"
while [[ "$1" == --* ]]; do shift; done
for n in 0 1; do SLURM_NODEID=$n "$@" >> "$FAKE_LOG"; done
if [ -n "${FAKE_SRUN_WAIT:-}" ]; then
  trap 'echo "srun got USR1" >> "$FAKE_LOG"; exit 0' USR1
  while true; do sleep 0.05; done
fi
exit "${FAKE_SRUN_CODE:-0}"
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_JOB_NAME": "exp",
           "SLURM_JOB_ID": "4321", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8",
           "CONFIG": "configs/qwen25vl_8gpu_noncolocated.yaml", "RUN": str(tmp_path / "run")}
    return env, log


def _command(run: str, node: int) -> str:
    return (f".venv/bin/mimo-sft finetune --nproc-per-node 8 --nnodes 2 --master-addr gpu07 --master-port 24321 "
            f"--config configs/qwen25vl_8gpu_noncolocated.yaml --output-dir {run} --save {run}/checkpoints "
            f"--load-checkpoint auto --exit-signal-handler --lr 1e-5 --node-rank {node}")


def test_the_script_parses_and_its_dry_run_prints_each_nodes_command(slurm):
    from mimo_sft.config.loader import load_config
    from mimo_sft.train.elastic import LaunchOptions, split_launch_flags

    env, _log = slurm
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(SCRIPT), "--lr", "1e-5"], env={**env, "DRY_RUN": "1"}, capture_output=True,
                          text=True, cwd=ROOT, timeout=30)
    assert proc.returncode == 0, proc.stderr
    run = env["RUN"]
    assert proc.stdout.splitlines() == [f"node {n}: {_command(run, n)}" for n in (0, 1)]
    # what the launcher and the config loader make of node 1's command
    args = proc.stdout.splitlines()[1].split()[4:]  # after "node 1: .venv/bin/mimo-sft finetune"
    opts, rest = split_launch_flags(args)
    assert opts == LaunchOptions(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="gpu07", master_port=24321)
    cfg = load_config(rest)
    assert cfg.checkpoint.resume_auto and cfg.checkpoint.load_checkpoint is None  # no checkpoint yet: fresh
    assert cfg.train.exit_signal_handler and cfg.optimizer.lr == 1e-5 and cfg.logging.output_dir == run
    assert f"HANG_EXIT={HANG_EXIT_CODE}\n" in SCRIPT.read_text()  # the watchdog's code (train/watchdog.py)
    assert "#SBATCH --requeue\n" in SCRIPT.read_text() and "#SBATCH --signal=B:USR1@" in SCRIPT.read_text()


@pytest.mark.parametrize("code, requeued", [(HANG_EXIT_CODE, True), (0, False), (2, False)])
def test_each_node_gets_its_rank_and_a_hang_is_requeued(slurm, code, requeued):
    env, log = slurm
    proc = subprocess.run(["bash", str(SCRIPT), "--lr", "1e-5"], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "MIMO_SFT": "echo", "FAKE_SRUN_CODE": str(code)}, timeout=30)
    assert proc.returncode == code, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c ")
    run = env["RUN"]
    assert lines[1:3] == [_command(run, n).replace(".venv/bin/mimo-sft ", "") for n in (0, 1)]
    assert (lines[3:] == ["requeue 4321"]) == requeued, lines
    assert ("requeueing job 4321" in proc.stdout) == requeued


def test_the_time_limit_signal_reaches_srun_and_the_stopped_run_is_requeued(slurm):
    env, log = slurm
    proc = subprocess.Popen(["bash", str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**env, "MIMO_SFT": "echo", "FAKE_SRUN_WAIT": "1"})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "--node-rank 1" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # what SLURM's --signal=B:USR1@300 does
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "the time limit is near: saving and stopping" in out
    assert log.read_text().splitlines()[-2:] == ["srun got USR1", "requeue 4321"]


def test_the_launcher_passes_sigusr1_on_to_its_workers(tmp_path, monkeypatch):
    """The workers' half (``record_pid``) and the parent's (``forward_signal``), with two real processes that
    stand in for workers: each leaves its pid and writes a file when SIGUSR1 arrives."""
    from mimo_sft.train.elastic import ERROR_DIR_ENV, forward_signal

    folder = tmp_path / "errors"
    folder.mkdir()
    worker = ("import os, signal, sys, time\n"
              "from mimo_sft.train.elastic import record_pid\n"
              "def stop(*_):\n"
              "    open(sys.argv[2], 'w').write('stop')\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGUSR1, stop)\n"
              "record_pid(int(sys.argv[1]))\n"
              "time.sleep(30)\n")
    env = {**os.environ, ERROR_DIR_ENV: str(folder), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), str(tmp_path / f"got_{r}")], env=env)
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(list(folder.glob("pid_*"))) < 2:
            time.sleep(0.05)
        assert sorted(forward_signal(str(folder), signal.SIGUSR1)) == sorted(p.pid for p in procs)
        assert [p.wait(timeout=20) for p in procs] == [0, 0]
        assert all((tmp_path / f"got_{r}").read_text() == "stop" for r in (0, 1))
        assert forward_signal(str(folder), signal.SIGUSR1) == []  # ended workers are passed over
    finally:
        for p in procs:
            p.kill()
