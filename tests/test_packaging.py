"""`pip install .` works as a normal Python package: the wheel declares the runtime dependencies (torch
only as a floor, so an installed CUDA torch is kept; megatron-core where its own metadata allows) and the
``tracking`` and ``test`` extras; requirements.txt (what `make install` uses) says the same; and pip, with
everything already installed, would install mimo-sft alone — torch is not replaced."""

import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: no build/ or egg-info beside the tests running in parallel
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "mimo_sft", src / "mimo_sft", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (path,) = (tmp / "dist").glob("mimo_sft-*.whl")
    return path


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode())


def _requirements_txt() -> set[str]:
    out = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.add(str(Requirement(line)))
    return out


def test_wheel_declares_runtime_dependencies_and_extras(wheel):
    meta = _metadata(wheel)
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    by_name = {}
    for r in reqs:
        by_name.setdefault(r.name, []).append(r)
    (torch,) = by_name["torch"]
    assert str(torch.specifier).startswith(">=") and "," not in str(torch.specifier), "torch: a floor only"
    (megatron,) = by_name["megatron-core"]
    assert str(megatron.specifier) == "==0.19.2"
    assert megatron.marker.evaluate({"python_version": "3.12", "extra": ""})
    assert not megatron.marker.evaluate({"python_version": "3.11", "extra": ""})
    for name in ("transformers", "datasets", "safetensors", "peft", "typer", "rich", "pyarrow", "pillow"):
        assert name in by_name and all(r.marker is None for r in by_name[name]), name
    assert set(meta.get_all("Provides-Extra")) >= {"tracking", "test"}
    extra = {e: {r.name for r in reqs if r.marker is not None and r.marker.evaluate({"extra": e, "python_version": "3.12"})
                 and not r.marker.evaluate({"extra": "", "python_version": "3.12"})} for e in ("tracking", "test", "gpu")}
    assert extra == {"tracking": {"wandb", "mlflow-skinny"}, "test": {"pytest", "pytest-xdist", "pytest-timeout"},
                     "gpu": {"flash-linear-attention"}}
    assert meta["Requires-Python"] == ">=3.11"
    # requirements.txt (make install) = the wheel's requirements without torch/megatron (install.sh pins those)
    # and without the gpu extra (fla: triton kernels; the CPU test environment must not have it)
    declared = {str(Requirement(str(r).split(";")[0])) for r in reqs
                if r.name not in ("torch", "megatron-core", "flash-linear-attention")}
    assert declared == _requirements_txt()


def test_pip_with_everything_installed_adds_only_mimo_sft(wheel, tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--report", str(report), f"{wheel}[tracking,test]"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert names == ["mimo-sft"], names
