"""The preloaded launcher (``tests/preloaded.py``) against real torchrun: the same environment in every
rank, the same exit codes, a failing rank stops the others, a timeout leaves no process behind, and a
run whose environment the preloaded parent froze at import goes to real torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time

import pytest

import preloaded
from dist_utils import free_port, run_distributed
from train_helpers import TORCHRUN, python_m, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]

TESTS = str(preloaded.TESTS)


def _env(**extra) -> dict:
    return dict(os.environ, **preloaded.RUN_ENV, **extra)


def _preloaded(nproc: int, argv: list[str], *, timeout: float = 120, **extra):
    """The probe on forked ranks: (exit code or None on timeout, stdout, stderr, seconds)."""
    env = _env(**extra)
    z = preloaded.usable(env)
    assert z is not None, "the preloaded parent should serve this environment"
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = preloaded.run_cli(z, nproc, argv, env=env, port=free_port(), timeout=timeout, out=out, err=err,
                                 cwd=TESTS, module="launcher_probe")
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read(), time.monotonic() - start


def _real(nproc: int, argv: list[str], **extra) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "-m", "launcher_probe", *argv]
    return subprocess.run(cmd, cwd=TESTS, env=_env(**extra), capture_output=True, text=True, timeout=120)


def _views(stdout: str) -> dict[int, dict]:
    views = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {int(v["env"]["RANK"]): v for v in views}


def test_every_rank_gets_torchruns_environment_and_the_runs_own():
    code, out, err, _ = _preloaded(2, ["env", "MIMO_SFT_PROBE"], MIMO_SFT_PROBE="a b")
    real = _real(2, ["env", "MIMO_SFT_PROBE"], MIMO_SFT_PROBE="a b")
    assert code == 0 == real.returncode, (err, real.stderr)
    got, want = _views(out), _views(real.stdout)
    assert sorted(got) == sorted(want) == [0, 1]
    for rank in (0, 1):
        g, w = got[rank], want[rank]
        for view in (g, w):
            view["env"].pop("MASTER_PORT")
            error_file = view["env"].pop("TORCHELASTIC_ERROR_FILE")
            assert error_file.endswith(f"/{rank}/error.json")
        assert g == w, (g, w)
        assert g["env"]["MIMO_SFT_PROBE"] == "a b" and g["env"]["LOCAL_RANK"] == str(rank)
        assert g["cwd"] == TESTS == g["path0"]


@pytest.mark.parametrize("argv", [["fail", "1", "3"], ["fail", "0", "2"], ["raise"]], ids=str)
def test_a_failing_rank_stops_the_others_with_torchruns_exit_code(argv):
    code, out, err, seconds = _preloaded(2, argv)
    real = _real(2, argv)
    assert code == real.returncode == 1, (code, err, real.returncode, real.stderr[-2000:])
    assert seconds < 60, "the sleeping rank should have been stopped at once"
    if argv[0] == "fail":
        line = f"rank {argv[1]} fails with {argv[2]}"
        assert line in err and line in real.stderr
        assert f"rank {argv[1]} (local_rank {argv[1]}) failed, exitcode {argv[2]}" in err
    else:  # both ranks raise; the first to fail is reported and the other may be stopped before its traceback
        assert re.search(r"RuntimeError: probe failure on rank [01]", err), err[-2000:]
        assert re.search(r"RuntimeError: probe failure on rank [01]", real.stderr), real.stderr[-2000:]


def test_ranks_rendezvous_on_the_launchers_store_and_exit_like_an_interpreter():
    code, out, err, _ = _preloaded(2, ["allreduce"])
    assert code == 0, err
    assert sorted(json.loads(line)["sum"] for line in out.splitlines()) == [3.0, 3.0]
    code, out, err, _ = _preloaded(1, ["exit-path"])
    assert code == 0, err
    assert out.splitlines() == ["main done", "thread done", "atexit ran"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_run_past_its_timeout_is_killed_with_everything_it_started(tmp_path):
    code, _out, _err, seconds = _preloaded(2, ["hang", str(tmp_path)], timeout=8)
    assert code is None and seconds < 60
    pids = [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == 4, pids  # two ranks, a grandchild each
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)]


def test_an_environment_frozen_at_import_goes_to_real_torchrun():
    z = preloaded.zygote()
    assert z is not None
    # the zygote recorded what its imports read, and started no thread of its own (a fork copies one)
    assert {"HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_VERBOSITY"} <= z.frozen
    assert all(t == z.threads[0] or t == "jemalloc_bg_thd" for t in z.threads), z.threads
    env = dict(z.env)
    assert preloaded.frozen_mismatch(dict(env, MIMO_SFT_TEST_HOLD_WRITER="1", PYTHONWARNINGS="default"), z.env,
                                     z.frozen) == []
    assert preloaded.frozen_mismatch(dict(env, TRANSFORMERS_VERBOSITY="info", PYTHONHASHSEED="3"), z.env,
                                     z.frozen) == ["PYTHONHASHSEED", "TRANSFORMERS_VERBOSITY"]
    bad = torchrun(1, ["--micro-batch-sise", "4"], command="validate", check=False,
                   extra_env={"TRANSFORMERS_VERBOSITY": "error"})
    assert bad.args[0] == TORCHRUN
    ours = torchrun(1, ["--micro-batch-sise", "4"], command="validate", check=False)
    real = torchrun(1, ["--micro-batch-sise", "4"], command="validate", check=False, real=True)
    assert ours.args[0] == "<preloaded>" and real.args[0] == TORCHRUN
    errors = [[line for line in p.stderr.splitlines() if line.startswith("error:")] for p in (ours, real, bad)]
    assert errors[0] == errors[1] == errors[2] and "did you mean '--micro-batch-size'" in errors[0][0]
    assert ours.returncode == real.returncode == bad.returncode == 1


def _sum_ranks(rank, world, scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "pid": os.getpid()}


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses")
    import torch.distributed as dist

    dist.barrier()  # never completes: the failing rank's exit stops this one


def test_run_distributed_forks_the_function_and_reports_a_failing_rank():
    res = run_distributed(_sum_ranks, 3, 2.0)
    assert [r["sum"] for r in res] == [6.0] * 3 and [r["rank"] for r in res] == [0, 1, 2]
    assert len({r["pid"] for r in res}) == 3 and os.getpid() not in {r["pid"] for r in res}
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1:(.|\n)*ValueError: rank one refuses"):
        run_distributed(_fail_on_one, 2)
    assert time.monotonic() - start < 60


def test_python_m_is_one_process_with_its_own_exit_code(tmp_path):
    """``python -m mimo_sft`` forked: the same exit code and error lines as the interpreter, no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    args = ["finetune", "--component", "language=dp=2", "--component", "images=dp=2", "--output-dir", str(tmp_path)]
    ours, real = python_m(args, env=env), python_m(args, env=env, real=True)
    assert ours.args[0] == "<preloaded>" and real.args[0] != "<preloaded>"
    assert ours.returncode == real.returncode == 2, (ours.stderr, real.stderr)
    assert ours.stderr == real.stderr and ours.stderr.startswith("error: ")
