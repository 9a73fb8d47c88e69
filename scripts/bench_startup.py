"""Start-up seconds by part (issue 53 item 5, CPU): what the trainer's start-up line says, per model.

    .venv/bin/python scripts/bench_startup.py [--cases tiny,tiny-random,3b-random] [--steps 3] [--repeat 1]
    .venv/bin/python scripts/bench_startup.py --suite swiglu [--tokens 2048,2304,4096]

Each case is a fresh process (the clock counts from the process's start) that loads and checks the flags as
``finetune`` does, runs the trainer's set-up (``train.trainer.Trainer.setup``: groups, model, optimizer, data,
the first micro-batch) and ``--steps`` training steps, then prints the start-up figures (``startup_*``, the
first metrics row's) and each step's seconds. One rank (both modules, ``language=dp=1 images=dp=1``), the
synthetic document dataset, bf16 for the real-width case as a GPU run trains.

* ``tiny``: the tiny Qwen2.5-VL checkpoint (``make_tiny_qwen_vl.py``), its weights loaded;
* ``tiny-random``: the same folder with ``--allow-random-init``;
* ``3b-random``: Qwen2.5-VL-3B's architecture (``make_tiny_qwen_vl.py --preset qwen2.5-vl-3b --config-only``,
  random init), the whole vision tower (32 blocks, 1280 wide) and the real vocabulary, with the language model
  cut to 2 of its 36 layers (config.json's ``num_hidden_layers``) so that it fits this machine; set-up only
  (``--steps`` does not apply: a bf16 step of it on 2 cores takes minutes).

``--suite tower``: Qwen2.5-VL-3B's vision tower alone, built as the builder built it before
(``model.tower_build``: the plain class on the host, with and without initialisation) and as it builds it now
(from a checkpoint: meta parameters then ``to_empty``; with random init, the host's share is the buffers' skeleton).

``--suite swiglu``: megatron's fused SwiGLU (``megatron.core.fusions.fused_bias_swiglu``) at a new packed length
each call -- what a packed run gives it -- compiled by inductor as megatron declares it (``torch.compile``),
compiled with ``dynamic=True``, and uncompiled (megatron's own formula, and mimo-sft's
``parallel.megatron_patches.swiglu_uncompiled``): each call's seconds (forward and backward) over the lengths and
again over the same lengths, and how many times dynamo compiled. Qwen2.5-VL-3B's MLP width (2 x 11008), fp32 on the
CPU, each variant in a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``), as on a fresh
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("tiny", "tiny-random", "3b-random")


def _child(flags: list[str], steps: int) -> None:
    """In a fresh process: ``finetune``'s checks and the trainer's set-up, ``steps`` steps; one JSON line."""
    sys.path.insert(0, ROOT)
    from mimo_sft.quiet import quiet_libraries
    from mimo_sft.train.launch import checked_config

    cfg, result = checked_config(flags, None)
    quiet_libraries()
    from mimo_sft.train.trainer import Trainer

    trainer = Trainer(cfg, result.layout)
    trainer.setup()
    times = []
    for _ in range(steps):
        step = trainer.train_step()
        trainer.log_step(step)
        times.append(step.step_time_s)
    print("BENCH " + json.dumps({**trainer.startup_figures, "steps": times}), flush=True)
    os._exit(0)  # the figures are out: no teardown to wait for


def _inputs(work: str, env: dict) -> dict:
    """The model folders and the dataset (each written by its script in a process of its own)."""
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, env=env, check=True, capture_output=True)  # noqa: E731
    tiny, big, data = (os.path.join(work, n) for n in ("tiny", "3b", "data"))
    run("scripts/make_tiny_qwen_vl.py", tiny)
    run("scripts/make_tiny_qwen_vl.py", big, "--preset", "qwen2.5-vl-3b", "--config-only")
    with open(os.path.join(big, "config.json")) as fh:
        config = json.load(fh)
    text = config.get("text_config", config)
    text["num_hidden_layers"] = 2
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:2]
    with open(os.path.join(big, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    run("scripts/make_demo_data.py", data, "--samples", "16")
    return {"tiny": tiny, "3b": big, "data": data}


def _flags(case: str, paths: dict, out: str, steps: int) -> list[str]:
    model = paths["3b" if case.startswith("3b") else "tiny"]
    flags = ["--hf-model", model, "--dataset-path", paths["data"], "--output-dir", out, "--component", "language=dp=1",
             "--component", "images=dp=1", "--seq-length", "1024" if case.startswith("3b") else "256",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(max(steps, 1)), "--no-save",
             "--no-tensorboard", "--num-workers", "1", "--dataloader-type", "cyclic", "--lr", "1e-5"]
    if case.endswith("random"):
        flags.append("--allow-random-init")
    if case.startswith("3b"):
        flags += ["--dtype", "bf16", "--gpu-memory-gb", "1000"]
    return flags


def startup_suite(args) -> None:
    from mimo_sft.testing.bench_runs import bench_env
    from mimo_sft.train.startup import PARTS

    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_startup_")
    paths = _inputs(work, env)
    rows = []
    for case in args.cases.split(","):
        assert case in CASES, f"--cases: one of {CASES}"
        for i in range(args.repeat):
            steps = 0 if case.startswith("3b") else args.steps
            out = os.path.join(work, f"{case}_{i}")
            done = subprocess.run([sys.executable, __file__, "--child", str(steps), "--", *_flags(case, paths, out, steps)],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            line = [x for x in done.stdout.splitlines() if x.startswith("BENCH ")]
            if done.returncode != 0 or not line:
                raise SystemExit(f"{case} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            rows.append((case, json.loads(line[0][len("BENCH "):])))
    print(f"1 CPU process (OMP_NUM_THREADS=1), start-up seconds by part (train.startup); steps: each step's seconds")
    print("| case | total | " + " | ".join(p.replace("_", " ") for p in PARTS) + " | steps |")
    print("|---|" + "---|" * (len(PARTS) + 2))
    for case, r in rows:
        steps = ", ".join(f"{s:.2f}" for s in r["steps"]) or "-"
        print(f"| {case} | {r['startup_s']:.1f} | " + " | ".join(f"{r[f'startup_{p}_s']:.2f}" for p in PARTS)
              + f" | {steps} |")


SWIGLU_VARIANTS = ("compiled (megatron's torch.compile)", "compiled, dynamic=True", "uncompiled, megatron's formula",
                   "uncompiled, swiglu_uncompiled (mimo-sft)")


def swiglu_suite(args) -> None:
    """Each variant in a fresh process (dynamo's caches and counters start empty)."""
    from mimo_sft.testing.bench_runs import bench_env

    lengths = [int(n) for n in args.tokens.split(",")]
    print(f"megatron's SwiGLU (forward + backward) at packed lengths {lengths}, then the same lengths again; width "
          f"2 x 11008, fp32, 1 CPU thread, inductor's cache empty; seconds per call")
    print("| variant | first pass (new lengths) | second pass | dynamo compiles |")
    print("|---|---|---|---|")
    for variant in SWIGLU_VARIANTS:
        cold = tempfile.mkdtemp(prefix="inductor_")  # inductor's on-disk cache empty, as on a fresh machine
        done = subprocess.run([sys.executable, __file__, "--swiglu-child", variant, args.tokens], cwd=ROOT,
                              env=dict(bench_env(), TORCHINDUCTOR_CACHE_DIR=cold), capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("BENCH ")]
        if done.returncode != 0 or not line:
            raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
        r = json.loads(line[0][len("BENCH "):])
        n = len(lengths)
        first, second = (", ".join(f"{s:.2f}" for s in part) for part in (r["seconds"][:n], r["seconds"][n:]))
        print(f"| {variant} | {first} | {second} | {r['compiles']} |")


def _swiglu_child(variant: str, tokens: str) -> None:
    import time

    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, ROOT)
    import mimo_sft.parallel  # noqa: F401  (makes megatron importable)
    from megatron.core.fusions import fused_bias_swiglu as fused

    from mimo_sft.parallel.megatron_patches import swiglu_uncompiled

    if variant.endswith("(mimo-sft)"):
        swiglu_uncompiled()
    for name in ("swiglu", "swiglu_back"):
        original = getattr(getattr(fused, name), "_torchdynamo_orig_callable", None)
        if original is None:
            continue
        if variant.startswith("uncompiled"):
            setattr(fused, name, original)
        elif "dynamic" in variant:
            setattr(fused, name, torch.compile(original, dynamic=True))
    seconds = []
    lengths = [int(x) for x in tokens.split(",")]
    for n in lengths + lengths:
        x = torch.randn(n, 2 * 11008, requires_grad=True)
        t0 = time.perf_counter()
        fused.bias_swiglu_impl(x, None).sum().backward()
        seconds.append(time.perf_counter() - t0)
    print("BENCH " + json.dumps({"seconds": seconds, "compiles": counters["stats"]["unique_graphs"]}), flush=True)


def tower_suite(args) -> None:
    """Qwen2.5-VL-3B's vision tower alone, each way in a fresh process (1 thread, bf16 as a GPU run builds it)."""
    from mimo_sft.testing.bench_runs import bench_env

    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_tower_")
    model = os.path.join(work, "3b")
    subprocess.run([sys.executable, "scripts/make_tiny_qwen_vl.py", model, "--preset", "qwen2.5-vl-3b", "--config-only"],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    print("Qwen2.5-VL-3B's vision tower (32 blocks, 1280 wide, 669M parameters), bf16, 1 CPU thread; seconds")
    print("| build | seconds | what a GPU run does with it |")
    print("|---|---|---|")
    for way, note in TOWER_WAYS.items():
        done = subprocess.run([sys.executable, __file__, "--tower-child", way, model], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("BENCH ")]
        if done.returncode != 0 or not line:
            raise SystemExit(f"{way} failed:\n{done.stderr[-3000:]}")
        print(f"| {way} | {json.loads(line[0][len('BENCH '):]):.2f} | {note} |")


TOWER_WAYS = {
    "plain class, random init (the build before)": "before, random init: this on the host, then a 1.34 GB copy to the GPU",
    "plain class, no init (the build before, from a checkpoint)": "before, from a checkpoint: this, the weights copied "
                                                                  "into host memory, then the 1.34 GB copy",
    "build_tower, from a checkpoint (meta, to_empty on the CPU)": "after: the same with to_empty on the GPU; the "
                                                                  "checkpoint's tensors copied in once",
    "build_tower's skeleton (meta parameters, host buffers)": "after, random init: the host's share (the "
                                                              "initialisers run as GPU kernels)",
}


def _tower_child(way: str, model: str) -> None:
    import time

    import torch

    sys.path.insert(0, ROOT)
    from transformers.initialization import no_init_weights

    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.model.tower_build import _skeleton, build_tower

    raw = read_config_json(model)
    adapter = get_family(raw, hf_dir=model)
    cls, params = adapter.encoder_class(), adapter.encoder_params(adapter.load_hf_config(model, raw),
                                                                 attn_implementation="eager")
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    if way.startswith("plain class, random"):
        cls(**params)
    elif way.startswith("plain class, no init"):
        with no_init_weights():
            cls(**params)
    elif way.startswith("build_tower, from"):
        build_tower(cls, params, device=torch.device("cpu"), from_checkpoint=True)
    else:
        _skeleton(cls, params)
    print("BENCH " + json.dumps(time.perf_counter() - t0), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return _child(sys.argv[sys.argv.index("--") + 1:], int(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[1] == "--swiglu-child":
        return _swiglu_child(sys.argv[2], sys.argv[3])
    if len(sys.argv) > 3 and sys.argv[1] == "--tower-child":
        return _tower_child(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("startup", "swiglu", "tower"), default="startup")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--tokens", default="2048,2304,4096,1536")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    {"startup": startup_suite, "swiglu": swiglu_suite, "tower": tower_suite}[args.suite](args)


if __name__ == "__main__":
    main()
