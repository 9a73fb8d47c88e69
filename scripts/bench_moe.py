#!/usr/bin/env python
"""Qwen3-VL-MoE step time and tokens per expert (max/mean) on CPU at a mid width, per expert layout.

    .venv/bin/python scripts/bench_moe.py [--quick] [--text-hidden 512] [--text-layers 2] [--experts 32] [--topk 4]

Why: issue 35's expert parallelism moves tokens between ranks (megatron's alltoall dispatcher) and
reports how unevenly the router spreads them (``moe_load_max_over_mean``: the most loaded expert's
tokens over the mean, worst layer; 1.0 is perfectly even). This runs real ``mimo-sft finetune``
processes under torchrun (gloo, CPU) of one Qwen3-VL-MoE and prints, per layout, the mean step time
and tokens/s over the steps after the first (which includes start-up), and the load figure per
layer and for the worst layer (means over the same steps). Layouts:

* 1 process (language and images dp 1, colocated);
* 3 processes: language dp 2 x ep 2 (each language rank holds half the experts; tokens cross ranks
  in the all-to-all) fed by one encoder rank (non-colocated);
* the same 3 ranks with ep 1 (each language rank holds every expert): what ep costs on this machine.

The model: ``make_tiny_qwen_vl.py --family qwen3_vl_moe --config-only`` at ``--text-hidden`` /
``--text-layers`` (every layer sparse), its config.json then given ``--experts`` experts, top
``--topk``, experts ``--expert-ffn`` wide (default hidden / 2), and random weights (transformers' init,
seed 0) written once, so that every layout starts from the same model and routes the same tokens:
the load columns and the loss then agree across rows up to the reduction order. ``--random-init``
writes no weights and trains with ``--allow-random-init`` instead (each layout draws its own
weights, so the rows' loads differ). The vision tower stays tiny. Data: the synthetic document dataset
(``make_demo_data.py``), with in-batch packing (the default: the experts see real tokens only);
``--padded`` trains with ``--no-in-batch-packing``, whose padded positions are routed and computed
too and so count in the load figures (the ``padding`` column: their share of the positions).

On CPU with gloo the all-to-all runs on the same cores as the experts' matmuls: the ep 2 row's step
time is no forecast of a GPU's all-to-all over NVLink, and a random router is no trained one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mimo_sft.testing.bench_runs import (  # noqa: E402
    bench_env, finetune_command, read_metrics, run_session, write_inputs)

#: (name, processes, --component values, expert-parallel size)
LAYOUTS = [
    ("1 process", 1, ["language=dp=1", "images=dp=1"], 1),
    ("language dp 2 x ep 2 + 1 encoder rank", 3, ["language=dp=2,ep=2", "images=dp=1,rank_offset=2"], 2),
    ("language dp 2, ep 1 + 1 encoder rank", 3, ["language=dp=2", "images=dp=1,rank_offset=2"], 1),
]
#: random weights for a config.json, as ``testing.tiny_checkpoint`` writes the tiny model's (seed 0)
SAVE_WEIGHTS = ("import sys, torch; from transformers import AutoConfig, Qwen3VLMoeForConditionalGeneration as M; "
                "torch.manual_seed(0); M(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[1])")
QUICK = dict(text_hidden=128, text_layers=2, experts=8, topk=2, steps=3, seq_length=256, samples=32)


def write_moe_model(work: str, args, env: dict) -> tuple[str, str]:
    """``(model, data)``: the config-only Qwen3-VL-MoE at the bench's width with its experts set, and the data."""
    flags = ["--family", "qwen3_vl_moe", "--config-only", "--text-hidden", str(args.text_hidden),
             "--text-layers", str(args.text_layers), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
             "--intermediate", str(2 * args.text_hidden)]
    model, data = write_inputs(work, root=ROOT, env=env, model_flags=flags, data_flags=["--samples", str(args.samples)])
    path = os.path.join(model, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["text_config"].update(num_experts=args.experts, num_experts_per_tok=args.topk,
                              moe_intermediate_size=args.expert_ffn, decoder_sparse_step=1, mlp_only_layers=[])
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    if not args.random_init:  # transformers' own init, saved once: every layout starts from the same weights
        subprocess.run([sys.executable, "-c", SAVE_WEIGHTS, model], cwd=ROOT, check=True, capture_output=True, env=env)
    return model, data


def run_layout(work: str, layout, *, model: str, data: str, args, env: dict) -> dict:
    """One layout's fine-tune; its means over the steps after the first."""
    name, nproc, components, ep = layout
    out = os.path.join(work, name.split(" +")[0].replace(" ", "_").replace(",", ""))
    cmd = finetune_command(nproc, [
        "--hf-model", model, *(["--allow-random-init"] if args.random_init else []), "--dataset-path", data, "--output-dir", out,
        *(x for c in components for x in ("--component", c)), "--seq-length", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.steps), "--dataloader-type", "cyclic", "--lr", "1e-4", "--seed", "1234",
        "--no-tensorboard", "--no-save", *(["--no-in-batch-packing"] if args.padded else [])])
    run_session(cmd, cwd=ROOT, env=env, log=out + ".log")
    m = read_metrics(out)
    layers = sorted((k for k in m[0] if k.startswith("moe_load_max_over_mean_layer_")),
                    key=lambda k: int(k.rsplit("_", 1)[1]))
    return dict(name=name, ranks=nproc, ep=ep, step=statistics.mean(r["step_time_s"] for r in m),
                tps=statistics.mean(r["tokens_per_s"] for r in m),
                load=statistics.mean(r["moe_load_max_over_mean"] for r in m),
                layers=[statistics.mean(r[k] for r in m) for k in layers], loss=m[-1]["loss"],
                padding=statistics.mean(r["padding_fraction"] for r in m))


def print_table(rows: list[dict], args) -> None:
    print(f"Qwen3-VL-MoE, language {args.text_hidden} wide x {args.text_layers} layers (all sparse), "
          f"{args.experts} experts, top {args.topk}, expert FFN {args.expert_ffn}; CPU ranks (gloo), "
          f"--seq-length {args.seq_length}, micro-batch {args.micro_batch_size}, global batch "
          f"{args.global_batch_size}, {'padded rows' if args.padded else 'in-batch packing'}, {args.steps} steps, "
          f"means over steps 2..{args.steps} (worst layer: each step's, then the mean)")
    print("| layout | ranks | ep | step time (s, mean) | tokens/s | experts max/mean (worst layer) | "
          "per layer max/mean | padding | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        layers = " / ".join(f"{x:.2f}" for x in r["layers"])
        print(f"| {r['name']} | {r['ranks']} | {r['ep']} | {r['step']:.2f} | {r['tps']:.0f} | {r['load']:.2f} | "
              f"{layers} | {r['padding']:.0%} | {r['loss']:.4f} |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and short run (smoke test)")
    ap.add_argument("--text-hidden", type=int, default=512)
    ap.add_argument("--text-layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--expert-ffn", type=int, default=None, help="experts' width (default: --text-hidden / 2)")
    ap.add_argument("--steps", type=int, default=4, help="--train-iters; the first step is not timed")
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=64, help="synthetic dataset size")
    ap.add_argument("--random-init", action="store_true",
                    help="write no weights, train with --allow-random-init (each layout then draws its own)")
    ap.add_argument("--padded", action="store_true",
                    help="--no-in-batch-packing: the experts route and compute the padding too")
    ap.add_argument("--no-ep1", action="store_true", help="skip the 3-rank ep 1 comparison row")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    args.expert_ffn = args.expert_ffn or args.text_hidden // 2
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    env = bench_env()
    work = tempfile.mkdtemp(prefix="bench_moe_")
    model, data = write_moe_model(work, args, env)
    layouts = LAYOUTS[:2] if args.no_ep1 else LAYOUTS
    print_table([run_layout(work, lay, model=model, data=data, args=args, env=env) for lay in layouts], args)


if __name__ == "__main__":
    main()
