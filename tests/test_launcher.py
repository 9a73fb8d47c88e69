"""``mimo-sft finetune --nproc-per-node N`` (issue 44 item 1, ``train.elastic``): the config checked once before any
worker starts, workers started through torch's elastic launch API, a failure reported as its first rank's line
once with that rank's exit code, no traceback; losses equal a torchrun launch's; ``--max-restarts`` restarts the
workers and they resume (the requeue test: the killed workers' restart is what a failed start's would be).

Real processes (the launcher forks nothing from the test's preloaded parent): each launch starts 2 fresh workers."""

import json
import os

import pytest

from checkpoint_payloads import planted
from e2e_runs import GROUP_STOP, never_stopped
from train_helpers import demo_data, metrics, new_dir, python_m, tiny_model, torchrun

from mimo_sft.errors import UserError
from mimo_sft.train.elastic import LaunchOptions, first_failure, launch_config, split_launch_flags

pytestmark = [pytest.mark.e2e, GROUP_STOP]

TWO = ["--component", "language=dp=1", "--component", "images=dp=1,rank_offset=1"]
FLAGS = ["--seq-length", "160", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
         "--lr", "3e-3", "--lr-decay-style", "constant", "--dataloader-type", "cyclic", "--no-tensorboard", "--no-save"]


def _launch(out: str, *extra: str, env: dict | None = None, components=TWO, nproc: int = 2):
    args = ["finetune", "--nproc-per-node", str(nproc), "--hf-model", tiny_model(), "--dataset-path", demo_data(),
            *components, *FLAGS, "--output-dir", out, *extra]
    return python_m(args, real=True, env=None if env is None else {**os.environ, **env}, timeout=400)


def requeue_flags() -> list[str]:
    """The requeue test's flags: 6 steps, a checkpoint every 2 (constant LR: its first steps are a 2-step run's)."""
    return ["--hf-model", tiny_model(), "--dataset-path", demo_data(), *TWO, *FLAGS[:-1], "--train-iters", "6",
            "--save-interval", "2"]


_REFERENCE: list = []


def torchrun_reference() -> str:
    """The torchrun launch of :func:`requeue_flags` (once per worker): the requeued run's losses, and the first two
    of them a launch of :data:`FLAGS`'."""
    if not _REFERENCE:
        ref = new_dir("launch_torchrun")
        torchrun(2, [*requeue_flags(), "--output-dir", ref])
        _REFERENCE.append(ref)
    return _REFERENCE[0]


def _no_traceback(proc) -> list[str]:
    """The error lines; asserts there is no traceback anywhere and no launcher chatter."""
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def test_launch_flags_and_config():
    opts, rest = split_launch_flags(["--nproc-per-node", "4", "--x", "1", "--nnodes=2", "--node-rank", "1",
                                     "--master-addr", "node0", "--master-port", "6000", "--max-restarts", "3"])
    assert rest == ["--x", "1"] and opts == LaunchOptions(4, 2, 1, "node0", 6000, 3) and opts.world_size == 8
    config = launch_config(opts)
    assert (config.nproc_per_node, config.min_nodes, config.max_nodes, config.max_restarts) == (4, 2, 2, 3)
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "node0:6000"
    assert config.rdzv_configs["is_host"] is False and config.run_id == "mimo-sft-node0-6000"
    assert split_launch_flags(["--lr", "1"]) == (None, ["--lr", "1"])
    for bad, says in ((["--nnodes", "2"], "without --nproc-per-node"), (["--nproc-per-node", "x"], "whole number"),
                      (["--nproc-per-node", "2", "--node-rank", "2", "--nnodes", "2"], "a node rank below")):
        with pytest.raises(UserError, match=says):
            split_launch_flags(bad)
    # one process is "1 process" (the parent's check: train.launch.checked_config)
    from mimo_sft.train.launch import checked_config

    with pytest.raises(UserError) as err:
        checked_config(TWO, 1, started_by=LaunchOptions(1).started_by)
    assert str(err.value).startswith("--nproc-per-node 1 starts 1 process, but the components use 2 ranks;"), err.value
    with pytest.raises(UserError, match="^--world-size 2 but 1 process was started; drop --world-size or start 2 "):
        checked_config([*TWO, "--world-size", "2"], 1)


def test_the_first_rank_to_fail_for_its_own_reason_is_reported(tmp_path):
    def write(rank, line, t, attempt=0):
        (tmp_path / f"rank_{rank:05d}.json").write_text(json.dumps(
            {"rank": rank, "line": line, "code": 2, "time": t, "attempt": attempt,
             "peer": "another rank failed" in line}))

    write(0, "error: [rank 0] stopped because another rank failed (see its error above)", 1.0)
    write(1, "error: [rank 1] the real reason", 2.0)
    assert first_failure(str(tmp_path))["rank"] == 1
    write(2, "error: [rank 2] a later start's reason", 0.5, attempt=1)
    assert first_failure(str(tmp_path))["rank"] == 2


def test_a_refused_config_is_its_lines_before_any_worker_starts(tmp_path):
    proc = _launch(new_dir("launch_refused"), "--micro-batch-size", "0")
    errors = _no_traceback(proc)
    assert proc.returncode == 2 and errors and all(e.startswith("error: [") for e in errors), proc.stderr[-2000:]
    assert "[rank" not in proc.stderr  # the parent's check, not a worker's
    # nodes x processes that are not the components' ranks: one line naming the flags, before any rendezvous
    # (node 1 of 2 alone: it would wait for node 0 otherwise)
    proc = _launch(new_dir("launch_nodes"), "--nnodes", "2", "--node-rank", "1", "--master-port", "29999")
    assert proc.returncode == 2 and _no_traceback(proc) == [
        "error: --nnodes 2 x --nproc-per-node 2 start 4 processes, but the components use 2 ranks; make --nnodes x "
        "--nproc-per-node 2, or change the components' dp/tp/pp/rank_offset"], proc.stderr[-2000:]


def test_a_launch_trains_as_torchrun_does_and_a_failing_rank_is_one_line(tmp_path):
    ours = new_dir("launch_ours")
    proc = _launch(ours)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_traceback(proc)
    ref = [(m["loss"], m["grad_norm"]) for m in metrics(torchrun_reference()) if "loss" in m]
    assert [(m["loss"], m["grad_norm"]) for m in metrics(ours)] == ref[:2]
    # a rank that fails at run time (a checkpoint whose rank file carries a payload): its line, once, exit 2
    folder, marker, refused = planted(os.path.join(never_stopped(), "checkpoints", "iter_0000004"), tmp_path,
                                      "model_metadata")
    proc = _launch(new_dir("launch_failing"), "--load-checkpoint", folder, "--train-iters", "6", nproc=1,
                   components=["--component", "language=dp=1", "--component", "images=dp=1"])
    errors = _no_traceback(proc)
    assert proc.returncode == 2 and len(errors) == 1 and refused in errors[0], proc.stderr[-3000:]
    assert not os.path.exists(marker)


def test_evaluate_with_a_config_takes_the_checkpoints_base_model(tmp_path):
    """Issue 44 item 4: a --config that names no model leaves --hf-model to the checkpoint's base model (it was
    refused: "no model folder given"); one that names a model keeps it."""
    cfg = tmp_path / "eval.yaml"
    cfg.write_text("data:\n  seq_length: 160\ntrain:\n  micro_batch_size: 2\n  global_batch_size: 4\n")
    ckpt = os.path.join(never_stopped(), "checkpoints")
    proc = python_m(["evaluate", ckpt, "--config", str(cfg), "--dataset-path", demo_data(), "--component",
                     "language=dp=1", "--component", "images=dp=1", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["hf_model"] == os.path.realpath(tiny_model()) and result["loss"] > 0


def test_load_checkpoint_auto_resolves_to_the_latest_checkpoint_or_a_fresh_start(tmp_path):
    """Issue 45 item 3's rule, without processes: the same command line serves the first start and a requeue."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    save = tmp_path / "ck"
    fresh = load_config(["--load-checkpoint", "auto", "--save", str(save)]).checkpoint
    assert fresh.load_checkpoint is None and fresh.resume_auto
    (save / "iter_0000004").mkdir(parents=True)
    (save / "latest").write_text("iter_0000004\n")
    assert load_config(["--load-checkpoint", "auto", "--save", str(save)]).checkpoint.load_checkpoint is None  # no meta
    (save / "iter_0000004" / "meta.json").write_text("{}")
    assert load_config(["--load-checkpoint", "auto", "--save", str(save)]).checkpoint.load_checkpoint == str(save)
    problems = [p.message for p in check_config(load_config(["--load-checkpoint", "auto"])).problems]
    assert not any("--load-checkpoint" in p for p in problems), problems  # OUTPUT_DIR/checkpoints by default


def test_metrics_of_steps_past_the_checkpoint_are_cut_on_resume(tmp_path):
    from mimo_sft.train.metrics import cut_after

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    cut_after(str(path), 2)
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2]


def test_a_requeued_run_resumes_from_its_last_checkpoint_with_the_continuous_losses():
    """Issue 45 item 3: both workers are killed while step 4's checkpoint is written (a test hook that fires on
    the first start only); --max-restarts 1 starts them again with the same command line, --load-checkpoint auto
    resumes from step 2, and the run ends with the continuous run's losses, each step logged once."""
    import subprocess
    import sys
    import tempfile

    from train_helpers import _kill_marked, _real_torchrun, _run_env

    flags = requeue_flags()
    out = new_dir("requeued")
    marker = f"requeue-{os.getpid()}"
    cmd = [sys.executable, "-m", "mimo_sft", "finetune", "--nproc-per-node", "2", "--max-restarts", "1", *flags,
           "--output-dir", out, "--save", out + "/ck", "--load-checkpoint", "auto"]
    with tempfile.TemporaryFile("w+") as o, tempfile.TemporaryFile("w+") as e:
        code = _real_torchrun(cmd, _run_env(marker, {"MIMO_SFT_TEST_KILL_AT": "start:4"}), 400, marker, o, e)
        _kill_marked(marker)  # megatron's checkpoint writers outlive a killed rank
        o.seek(0)
        e.seek(0)
        proc = subprocess.CompletedProcess(cmd, code, o.read(), e.read())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "--load-checkpoint auto: no checkpoint in" in proc.stdout and "starting fresh" in proc.stdout
    assert f"--load-checkpoint auto: resuming from {out}/ck" in proc.stdout
    ref = torchrun_reference()
    got = [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(out) if "loss" in m]
    assert got == [(m["step"], m["loss"], m["grad_norm"]) for m in metrics(ref) if "loss" in m]
    assert [s for s, _, _ in got] == [1, 2, 3, 4, 5, 6]
