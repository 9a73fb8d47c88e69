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

``--suite swiglu``: megatron's fused SwiGLU (``megatron.core.fusions.fused_bias_swiglu``) at a new packed length
each call -- what a packed run gives it -- compiled by inductor as megatron declares it (``torch.compile``),
compiled with ``dynamic=True``, and uncompiled: each call's seconds (forward and backward), and how many times
dynamo compiled. Qwen2.5-VL-3B's MLP width (2 x 11008), fp32 on the CPU.
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


def swiglu_suite(args) -> None:
    """Each variant in a fresh process (dynamo's caches and counters start empty)."""
    from mimo_sft.testing.bench_runs import bench_env

    lengths = [int(n) for n in args.tokens.split(",")]
    print(f"megatron's SwiGLU (forward + backward) at packed lengths {lengths}, width 2 x 11008, fp32, 1 CPU thread")
    print("| variant | seconds per call, in order | dynamo compiles |")
    print("|---|---|---|")
    for variant in ("compiled (megatron's torch.compile)", "compiled, dynamic=True", "uncompiled"):
        done = subprocess.run([sys.executable, __file__, "--swiglu-child", variant, args.tokens], cwd=ROOT,
                              env=bench_env(), capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("BENCH ")]
        if done.returncode != 0 or not line:
            raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
        r = json.loads(line[0][len("BENCH "):])
        print(f"| {variant} | {', '.join(f'{s:.2f}' for s in r['seconds'])} | {r['compiles']} |")


def _swiglu_child(variant: str, tokens: str) -> None:
    import time

    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, ROOT)
    import mimo_sft.parallel  # noqa: F401  (makes megatron importable)
    from megatron.core.fusions import fused_bias_swiglu as fused

    for name in ("swiglu", "swiglu_back"):
        original = getattr(fused, name)._torchdynamo_orig_callable
        if variant == "uncompiled":
            setattr(fused, name, original)
        elif "dynamic" in variant:
            setattr(fused, name, torch.compile(original, dynamic=True))
    seconds = []
    for n in (int(x) for x in tokens.split(",")):
        x = torch.randn(n, 2 * 11008, requires_grad=True)
        t0 = time.perf_counter()
        fused.bias_swiglu_impl(x, None).sum().backward()
        seconds.append(time.perf_counter() - t0)
    print("BENCH " + json.dumps({"seconds": seconds, "compiles": counters["stats"]["unique_graphs"]}), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return _child(sys.argv[sys.argv.index("--") + 1:], int(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[1] == "--swiglu-child":
        return _swiglu_child(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("startup", "swiglu"), default="startup")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--tokens", default="2048,2304,4096,1536")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    (swiglu_suite if args.suite == "swiglu" else startup_suite)(args)


if __name__ == "__main__":
    main()
