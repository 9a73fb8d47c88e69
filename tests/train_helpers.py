"""Helpers for the end-to-end training tests: tiny model and datasets, torchrun, checkpoint tensors.

``torchrun()`` runs ``mimo_sft`` on ranks forked from a preloaded parent (``tests/preloaded.py``:
the same environment, exit codes and output, without ~6 s of imports per rank); ``real=True`` starts
the real torchrun, for the tests of what torchrun itself does (signals, a rank killed mid-save).
"""

from __future__ import annotations

import atexit
import functools
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import preloaded
from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="mimo_sft_train_tests_"))
atexit.register(shutil.rmtree, _TMP, True)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@functools.lru_cache(maxsize=None)
def tiny_model() -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(_TMP / "tiny", seed=0))


@functools.lru_cache(maxsize=None)
def demo_data(samples: int = 96) -> str:
    from mimo_sft.testing.demo_data import write_demo_dataset

    return str(write_demo_dataset(_TMP / f"demo_{samples}", samples=samples, seed=0))


def _png(w: int, h: int, colour, *, truncate: bool = False) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    data = buf.getvalue()
    return data[: len(data) // 2] if truncate else data


@functools.lru_cache(maxsize=None)
def fixed_size_data(samples: int = 32, *, broken_image: int | None = None, junk_image: int | None = None) -> str:
    """Single-image samples of one image size.

    Images are files referenced by path; ``broken_image`` truncates one file so that its header
    reads but its pixels do not decode (only ranks that decode pixels fail); ``junk_image``'s file is not an
    image at all (every rank that reads the sample's header fails).
    """
    import datasets

    folder = _TMP / f"fixed_{samples}_{broken_image}_{junk_image}"
    (folder / "img").mkdir(parents=True, exist_ok=True)
    colours = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "black": (15, 15, 15)}
    rows = []
    for i in range(samples):
        name = sorted(colours)[i % len(colours)]
        path = folder / "img" / f"{i:04d}.png"
        png = _png(56, 56, colours[name], truncate=(i == broken_image))
        path.write_bytes(b"not an image" if i == junk_image else png)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Which colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"It is {name}."}]}],
            "images": [f"img/{i:04d}.png"]})
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "train.parquet"))
    return str(folder)


#: (width, height) of each image of each sample, in dataset order; () is a text-only sample. Read in
#: order (--dataloader-type single) as micro-batches of 4, so that on 2 ranks:
#: samples 0-3: images, images, text, text -> fan-in (images dp 2): rank 1's encoder slice has no
#:   image; fan-out (language dp 2): rank 1's language slice has no image token
#: samples 4-7: text, two images of different sizes, text, wide image -> mixed counts everywhere
#: samples 8-11: text only -> no rank runs the encoder
BRIDGE_CORNER_IMAGES = [[(56, 56)], [(112, 56)], (), (), (), [(56, 84), (28, 28)], (), [(140, 28)], (), (), (), ()]


@functools.lru_cache(maxsize=None)
def bridge_corner_data() -> str:
    """The samples of :data:`BRIDGE_CORNER_IMAGES` (colocated bridge corner cases), images by path."""
    import datasets

    folder = _TMP / "bridge_corner"
    (folder / "img").mkdir(parents=True, exist_ok=True)
    colours = [("red", (220, 30, 30)), ("green", (30, 170, 60)), ("blue", (40, 70, 220)), ("black", (15, 15, 15))]
    rows = []
    for i, sizes in enumerate(BRIDGE_CORNER_IMAGES):
        paths, names = [], []
        for j, (w, h) in enumerate(sizes):
            name, rgb = colours[(i + j) % len(colours)]
            path = f"img/{i:02d}_{j}.png"
            (folder / path).write_bytes(_png(w, h, rgb))
            paths.append(path)
            names.append(name)
        question = "Which colours?" if names else f"What is {i} plus {i + 1}?"
        answer = f"It is {' and '.join(names)}." if names else f"It is {2 * i + 1}."
        content = [{"type": "image", "text": None} for _ in paths] + [{"type": "text", "text": question}]
        rows.append({"messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                     "images": paths})
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"),
                                   "content": datasets.List({"type": datasets.Value("string"),
                                                             "text": datasets.Value("string")})}),
        "images": datasets.List(datasets.Value("string")),
    })
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(folder / "train.parquet"))
    return str(folder)


def torchrun(nproc: int, args: list[str], *, timeout: float = 300, check: bool = True,
             extra_env: dict | None = None, command: str = "finetune", real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC -m mimo_sft COMMAND ARGS``: on preloaded forked ranks, or
    with ``real=True`` (or where the preloaded parent cannot stand in, see ``preloaded.usable``)
    the real torchrun. Raises ``subprocess.TimeoutExpired`` past ``timeout`` (the run is killed)."""
    for _attempt in range(3):
        proc = _torchrun_once(nproc, args, timeout=timeout, extra_env=extra_env, command=command, real=real)
        # the agent's store could not bind its port (another process took it after free_port looked):
        # nothing ran yet, so a new port is a clean retry
        if not (proc.returncode != 0 and "EADDRINUSE" in proc.stderr and "failed to listen" in proc.stderr):
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


_RUNS = itertools.count()


def _kill_marked(marker: str) -> None:
    """SIGKILL every process that inherited this run's ``MIMO_SFT_TEST_RUN`` marker, as a cgroup kill
    would: torchrun starts each rank in a session of its own, and the processes a rank started
    (megatron's checkpoint writers and their queue manager) outlive a rank killed with SIGKILL,
    reparented to init, so neither the process group nor the process tree finds them."""
    needle = f"MIMO_SFT_TEST_RUN={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _run_env(marker: str, extra_env: dict | None) -> dict:
    return dict(os.environ, **preloaded.RUN_ENV, MIMO_SFT_TEST_RUN=marker, **(extra_env or {}))


def _torchrun_once(nproc: int, args: list[str], *, timeout: float, extra_env: dict | None,
                   command: str = "finetune", real: bool = False) -> subprocess.CompletedProcess:
    """One launch, preloaded or real; ``MIMO_SFT_TEST_RUN`` marks every process of the run (the real
    torchrun's ranks, and processes started from a forked rank) for :func:`_kill_marked`."""
    marker = f"{os.getpid()}-{next(_RUNS)}"
    env = _run_env(marker, extra_env)
    zygote = None if real else preloaded.usable(env)
    port = free_port()
    launcher = [TORCHRUN] if zygote is None else ["<preloaded>"]
    cmd = [*launcher, "--nproc-per-node", str(nproc), "--master-port", str(port), "-m", "mimo_sft", command, *args]
    # Own session, output to files: a rank killed with SIGKILL (the checkpoint tests do that) leaves
    # megatron's checkpoint-writer processes behind; they would hold a pipe open until the timeout.
    # The whole session is killed once the run returns, as a cluster scheduler would.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        if zygote is not None:
            try:
                code = preloaded.run_cli(zygote, nproc, [command, *args], env=env, port=port, timeout=timeout,
                                         out=out, err=err, cwd=str(ROOT))
            finally:
                _kill_marked(marker)  # a process that left the run's session (run_cli killed the session)
        else:
            code = _real_torchrun(cmd, env, timeout, marker, out, err)
        out.seek(0)
        err.seek(0)
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read(), stderr=err.read())
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def _real_torchrun(cmd: list[str], env: dict, timeout: float, marker: str, out, err) -> int | None:
    """The real torchrun in a session of its own; the exit code, None past ``timeout``."""
    child = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=str(ROOT), env=env, start_new_session=True)
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        preloaded.kill_session(child.pid)
        _kill_marked(marker)


def python_m(args: list[str], *, env: dict | None = None, cwd: str = str(ROOT), timeout: float = 300,
             real: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "mimo_sft", *args], capture_output=True, text=True)``
    (one process, no torchrun), forked from the preloaded parent where it can stand in for ``env``
    (default: this process's); ``real=True`` starts the interpreter. Raises ``TimeoutExpired``."""
    env = dict(os.environ if env is None else env)
    zygote = None if real else preloaded.usable(env)
    cmd = [sys.executable if zygote is None else "<preloaded>", "-m", "mimo_sft", *args]
    if zygote is None:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = preloaded.run_cli(zygote, 1, list(args), env=env, port=0, timeout=timeout, out=out, err=err,
                                 cwd=cwd, torchrun=False)
        out.seek(0)
        err.seek(0)
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read(), stderr=err.read())
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def checkpoint_tensors(ckpt_dir: str) -> dict:
    """Full (unsharded) model tensors of a mimo-sft checkpoint, keyed layout-independently."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(ckpt_dir, "model_full.pt")
    if not os.path.exists(out):
        dcp_to_torch_save(os.path.join(ckpt_dir, "model"), out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def new_dir(name: str) -> str:
    path = _TMP / name
    if path.exists():
        shutil.rmtree(path)
    return str(path)


def optimizer_tensors(ckpt_dir: str) -> dict:
    """Full (unsharded) optimizer tensors of a mimo-sft checkpoint (``optimizer/``: Adam moments, fp32
    main weights), keyed layout-independently."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(ckpt_dir, "optimizer_full.pt")
    if not os.path.exists(out):
        dcp_to_torch_save(os.path.join(ckpt_dir, "optimizer"), out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
