"""Stopping early on a cluster: a signal to one rank, --exit-interval, --exit-duration-in-mins.

Real torchrun processes on CPU. Every rank must stop after the same step with one checkpoint and
exit 0, and the resumed run must continue exactly where the run that never stopped would be.
"""

import os
import signal
import subprocess
import time

import pytest

from dist_utils import free_port
from e2e_runs import GROUP_STOP, never_stopped, stop_args
from mimo_sft.train.checkpoint.files import complete_checkpoints, resolve_checkpoint
from mimo_sft.train.stopping import StopPolicy, resume_command
from train_helpers import ROOT, TORCHRUN, metrics, new_dir, torchrun

pytestmark = [pytest.mark.e2e, GROUP_STOP]


def _args(out, iters, *components):
    return [*(stop_args(iters, components) if components else stop_args(iters)), "--output-dir", out]


def _losses(out):
    return {m["step"]: m["loss"] for m in metrics(out)}


def test_exit_interval_and_duration_stop_with_a_checkpoint_and_resume_exactly():
    ref = never_stopped()  # the same run with checkpoints at 2 and 4 (shared with test_checkpoint_kill.py)
    run = new_dir("stop_run")
    # with a background save of step 2 still being written when the stop comes (its writer held until the
    # poll after step 3): it is published, then the stop's own save, before the run exits
    first = torchrun(1, _args(run, 6) + ["--exit-interval", "3", "--async-save", "--save-interval", "2"],
                     extra_env={"MIMO_SFT_TEST_HOLD_WRITER": "1"})
    assert "stopped after step 3 of 6 (--exit-interval)" in first.stdout and "--load-checkpoint" in first.stdout
    assert first.stdout.index("iter_0000002") < first.stdout.index("iter_0000003")
    assert resolve_checkpoint(run + "/checkpoints").endswith("iter_0000003")
    assert [s for s, _v, _n in complete_checkpoints(run + "/checkpoints")] == [2, 3]
    # a budget too small for another step: stops after the step it is in
    second = torchrun(1, _args(run, 6) + ["--load-checkpoint", run + "/checkpoints", "--exit-duration-in-mins", "1e-4"])
    assert "stopped after step 4 of 6 (--exit-duration-in-mins)" in second.stdout
    torchrun(1, _args(run, 6) + ["--load-checkpoint", run + "/checkpoints"])
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(got[s] == want[s] for s in got), (got, want)


def _worker_pids(parent: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers (read from their environment)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def test_signal_to_one_rank_stops_every_rank_at_the_same_step():
    """SIGTERM reaches only the vision rank: the language rank stops with it, no hang, exit 0."""
    components = ("language=dp=1", "images=dp=1,rank_offset=1")
    ref = new_dir("sig_reference")
    torchrun(2, _args(ref, 12, *components))
    run = new_dir("sig_run")
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "mimo_sft", "finetune",
           *_args(run, 12, *components), "--exit-signal-handler"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (os.path.isfile(run + "/metrics.jsonl") and len(metrics(run)) >= 2):
            time.sleep(0.05)
        pids = _worker_pids(proc.pid)
        assert 1 in pids, pids
        os.kill(pids[1], signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-3000:]
    stopped = max(_losses(run))
    assert 2 <= stopped < 12 and f"stopped after step {stopped} of 12 (a signal)" in out
    assert [s for s, _v, _n in complete_checkpoints(run + "/checkpoints")] == [stopped]
    torchrun(2, _args(run, 12, *components) + ["--load-checkpoint", run + "/checkpoints"])
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == list(range(1, 13)) and all(got[s] == want[s] for s in got)


def test_stop_policy_rules():
    now = [100.0]
    p = StopPolicy(signal_handler=False, exit_interval=4, exit_duration_mins=1.0, clock=lambda: now[0])
    assert p.local_reason(3, 1.0) == 0 and p.local_reason(4, 1.0) == 1
    now[0] += 58.5
    assert p.local_reason(5, 1.0) == 0   # 58.5 s spent + a 1 s step fits in 60 s
    assert p.local_reason(5, 2.0) == 2   # a 2 s step would not
    p.signal_received = signal.SIGUSR1
    assert p.local_reason(5, 0.0) == 3 and p.active
    assert not StopPolicy(signal_handler=False, exit_interval=None, exit_duration_mins=None).active
    cmd = resume_command("/ck", 4, ["finetune", "--lr", "1e-5", "--load-checkpoint", "/old", "--output-dir", "a b"])
    assert cmd == "torchrun --nproc-per-node 4 -m mimo_sft finetune --lr 1e-5 --output-dir 'a b' --load-checkpoint /ck"
    # started by `mimo-sft finetune --nproc-per-node 2 --max-restarts 1`: the same launcher again (its workers' argv)
    from mimo_sft.train.elastic import LaunchOptions

    flags = " ".join(LaunchOptions(nproc_per_node=2, max_restarts=1).flags())
    assert flags == "--nproc-per-node 2 --max-restarts 1"
    cmd = resume_command("/ck", 2, ["finetune", "--lr", "1e-5", "--load-checkpoint", "/old"], launch_flags=flags)
    assert cmd == "mimo-sft finetune --nproc-per-node 2 --max-restarts 1 --lr 1e-5 --load-checkpoint /ck"
