"""`mimo-sft validate` through Typer's runner and as a real subprocess (exit codes, one-line errors)."""

import glob
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mimo_sft.cli import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = ["--component", "language=tp=1,pp=1,dp=2,rank_offset=0", "--component", "images=tp=1,dp=2,rank_offset=2",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--scalable-dp", "--intra-microbatch-reorder"]
runner = CliRunner()


def test_issue_example_is_valid_with_table():
    res = runner.invoke(app, ["validate", *GOOD])
    assert res.exit_code == 0, res.output
    assert "VALID" in res.output and "language" in res.output and "images" in res.output
    assert "canonical grid 2" in res.output and "non-colocated" in res.output
    assert "Resolved config" in res.output and "micro_batch_size: 4" in res.output


def test_validate_shows_packing_and_refuses_it_with_the_local_core():
    res = runner.invoke(app, ["validate", *GOOD, "--in-batch-packing"])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())  # (a console of another worker's width may wrap the line)
    assert "language: packed" in said and "auto attention (varlen on a CUDA GPU in bf16, else sdpa)" in said
    assert "in_batch_packing: true" in res.output
    res = runner.invoke(app, ["validate", *GOOD, "--in-batch-packing", "--attention-backend", "local"])
    assert res.exit_code == 2 and "[19] --in-batch-packing with --attention-backend local" in res.output


def test_invalid_lists_every_problem_and_exits_2():
    res = runner.invoke(app, ["validate", "--quiet", "--component", "language=tp=3,dp=2",
                              "--component", "images=dp=4,pp=2,rank_offset=1", "--micro-batch-size", "6"])
    assert res.exit_code == 2
    assert res.output.count("  x [") >= 4
    assert "Traceback" not in res.output


def test_json_output():
    res = runner.invoke(app, ["validate", "--json", *GOOD])
    data = json.loads(res.output)
    assert data["ok"] and data["world_size"] == 4 and data["canonical_grid"] == 2
    assert [m["module"] for m in data["modules"]] == ["language", "images"]


def test_world_size_override():
    res = runner.invoke(app, ["validate", "--json", *GOOD, "--world-size", "6"])
    assert res.exit_code == 2 and "world size 6" in json.loads(res.output)["problems"][0]


def test_help_lists_flags():
    res = runner.invoke(app, ["validate", "--help"])
    assert res.exit_code == 0 and "--intra-microbatch-reorder" in res.output and "--component" in res.output


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_validates(path):
    res = runner.invoke(app, ["validate", "--quiet", "--config", path])
    assert res.exit_code == 0, res.output


def test_bad_flag_is_one_line_without_traceback_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "validate", "--micro-batch-sise", "4"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "did you mean '--micro-batch-size'" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def _finetune(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "mimo_sft", "finetune", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_finetune_refuses_bad_config_before_starting(tmp_path):
    proc = _finetune(*GOOD, "--dataset-path", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no model: give --hf-model" in proc.stderr


def test_finetune_without_torchrun_says_how_to_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "text_config": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    proc = _finetune(*GOOD, "--hf-model", str(tmp_path), "--dataset-path", str(tmp_path))
    assert proc.returncode == 2
    assert "torchrun --nproc-per-node 4 -m mimo_sft finetune" in proc.stderr and "Traceback" not in proc.stderr


def test_finetune_world_size_mismatch_under_torchrun_env(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    proc = _finetune(*GOOD, "--hf-model", str(tmp_path), "--dataset-path", str(tmp_path),
                     env_extra={"RANK": "0", "WORLD_SIZE": "2"})
    assert proc.returncode == 2 and "world size 2 does not match the 4 ranks" in proc.stderr


def test_validate_refuses_a_model_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    res = runner.invoke(app, ["validate", "--json", *GOOD, "--hf-model", str(tmp_path)])
    data = json.loads(res.output)
    assert res.exit_code == 2 and any("no *.safetensors weights" in p for p in data["problems"])
    res = runner.invoke(app, ["validate", "--json", *GOOD, "--hf-model", str(tmp_path), "--allow-random-init"])
    assert json.loads(res.output)["ok"]


def test_finetune_refuses_to_reuse_another_runs_output_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    proc = _finetune("--component", "language=dp=1", "--component", "images=dp=1", "--hf-model", str(tmp_path),
                     "--dataset-path", str(tmp_path), "--output-dir", str(out))
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "choose a new --output-dir" in proc.stderr
    assert "Traceback" not in proc.stderr and "--load-checkpoint" not in proc.stderr  # nothing to resume from
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("iter_0000002\n")
    proc = _finetune("--component", "language=dp=1", "--component", "images=dp=1", "--hf-model", str(tmp_path),
                     "--dataset-path", str(tmp_path), "--output-dir", str(out))
    assert proc.returncode == 2 and f"--load-checkpoint {out}/checkpoints" in proc.stderr


def _piped_env(**extra):
    """The environment of a run whose stdout is a pipe or a log file: no terminal hints for rich."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, **extra}


def test_validate_to_a_pipe_prints_the_memory_table_whole(tmp_path):
    """Off a terminal rich would cut to 80 columns (headers ``mo…``, ``we…``); a log must hold them whole."""
    from mimo_sft.config.report import MEMORY_COLUMNS
    from mimo_sft.testing.tiny_checkpoint import preset_config

    preset_config("qwen2.5-vl-7b").save_pretrained(str(tmp_path))  # config.json only: the forecast reads no weights
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "validate", "--quiet", "--component", "language=dp=1",
                           "--component", "images=dp=1,rank_offset=1", "--hf-model", str(tmp_path), "--allow-random-init",
                           "--micro-batch-size", "1", "--global-batch-size", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_piped_env(), timeout=120)
    assert "Memory forecast per GPU" in proc.stdout, proc.stdout + proc.stderr
    header = next(ln for ln in proc.stdout.splitlines() if "module" in ln and "peak" in ln)
    assert "…" not in proc.stdout and all(f" {c} " in header for c in ("module", "rank", "params", *MEMORY_COLUMNS))
    assert "canonical groups per DP rank" in proc.stdout  # the layout table's header on one line too
    # COLUMNS is the user's say: rich's width again (and its cut headers)
    narrow = subprocess.run(proc.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=_piped_env(COLUMNS="80"), timeout=120)
    assert "…" in narrow.stdout


def test_make_console_keeps_rich_on_a_terminal(monkeypatch):
    import io

    from rich.console import Console

    from mimo_sft.console import NO_WRAP_WIDTH, make_console

    for name in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)
    assert make_console(file=io.StringIO()).width == NO_WRAP_WIDTH
    assert make_console(file=io.StringIO(), pipe_width=160).width == 160
    assert make_console(file=io.StringIO(), width=90).width == 90
    assert make_console(force_terminal=True).width == Console(force_terminal=True).width
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console(file=io.StringIO()).width == 100


def test_validate_without_model_or_data_imports_no_transformers_or_torchvision():
    """Issue 55 item 3: ``validate`` with neither --hf-model nor --dataset-path opens no source, so it imports
    neither transformers nor torchvision (nor torch): they took 4.6 of its 4.95 s when ``validate.check_config``
    imported the data loader every time (scripts/bench_validate.py has the figures, docs/benchmarks.md)."""
    probe = ("import sys\nfrom mimo_sft.cli import main\n"
             "sys.argv = ['mimo-sft', 'validate', '--quiet', '--component', 'language=tp=8,pp=4,dp=16,rank_offset=0',"
             " '--component', 'images=tp=1,dp=16,pp=1,rank_offset=512', '--micro-batch-size', '64',"
             " '--global-batch-size', '128', '--scalable-dp']\n"
             "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
             "print('LOADED', code, sorted(m for m in ('transformers', 'torchvision', 'torch', 'datasets')"
             " if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED")]
    assert line == ["LOADED 0 []"], proc.stdout[-2000:] + proc.stderr[-2000:]
