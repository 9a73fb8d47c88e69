#!/usr/bin/env python
"""Forecast vs measured activation bytes at real width, on the CPU: the table in docs/benchmarks.md.

    python scripts/bench_memory.py [--preset qwen2.5-vl-7b | qwen3.5-27b] [--tokens 512] [--patches 1024] [--dtype bf16] [--tp 2]

For one megatron decoder layer of the preset (built as mimo-sft builds it: our config, spec and SDPA
core, tp 1; for Qwen3.5's hybrid decoder, one of each kind: Gated DeltaNet, whose fla kernels keep what
fla keeps (``saved_bytes.fla_saved_tensors``), and gated full attention) with each recompute setting
(the ``cpu`` terms: what the CPU's kernels keep), without recomputation also on CUDA's dispatch path
(torch's fused RMSNorm: ``saved_bytes.cuda_rms_norm_saved_tensors``, derived from torch's own autograd node,
no GPU) and with the SwiGLU fusion off, its token mixer and MLP parts alone, one transformers
vision block of the preset's family (with and without ``--recompute-vision``'s checkpointing, full and windowed
attention, and three pages and a part at once: several images' windows and images), the patch merger (and Qwen3-VL's DeepStack mergers), megatron's vocab-parallel cross entropy on the preset's vocabulary, and
the layer on ``--tp`` gloo ranks with and without sequence parallelism (which needs the decoder norm
that supports it, ``model.norm``; without it those rows say so),
it prints the bytes ``mimo_sft.memory``'s formulas forecast and the bytes autograd saves
(``mimo_sft.testing.saved_bytes``: distinct storages seen by ``saved_tensors_hooks``), per token or
patch, and their ratio. Attention runs on torch's flash SDPA kernel, the one GPUs use.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = 84  # the table's first column
#: the MLP's terms: a dense MLP's, or a sparse layer's router, experts and shared expert
MLP_TERMS = ("mlp", "router", "experts", "shared expert")
#: several images in one micro-batch (``[t, h, w]`` patches): three pages, scaled down from 2 Mpx, and a part
PAGES = [[1, 42, 30]] * 3 + [[1, 16, 20]]
SETTINGS = {
    "no recompute": None,
    "selective core_attn": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "selective mlp": {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
    "selective core_attn,mlp": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full (uniform, 1 layer)": {"recompute_granularity": "full", "recompute_method": "uniform",
                                "recompute_num_layers": 1},
}


def layer_kinds(d):
    """``[(layer_type, label)]`` to measure: each kind of a hybrid decoder (Qwen3.5), else the one kind."""
    from mimo_sft.memory.dims import FULL_ATTENTION, LINEAR_ATTENTION

    if not d.layer_types:
        return [(FULL_ATTENTION, "")]
    names = {LINEAR_ATTENTION: " (GDN)", FULL_ATTENTION: " (full attention)"}
    return [(kind, names[kind]) for kind in (LINEAR_ATTENTION, FULL_ATTENTION) if kind in d.layer_types]


def _forecast(d, rc, *, tp, sp, b, layer_type, device="cpu", swiglu_fused=None):
    from mimo_sft.memory import activations as act

    if rc and rc["recompute_granularity"] == "full":
        return act.language_layer_input(d, tp=tp, sp=sp, b=b)
    mods = rc["recompute_modules"] if rc else ()
    fused = act.FUSED_SWIGLU if swiglu_fused is None else swiglu_fused
    # index 0: the measured one-layer block's layer (a mixture-of-experts preset's layer 0 is sparse)
    return sum(act.language_layer_terms(d, tp=tp, sp=sp, b=b, recompute_modules=mods, layer_type=layer_type,
                                        device=device, swiglu_fused=fused, index=0).values())


def language_rows(hf_dir, d, tokens, dtype, b):
    from mimo_sft.memory import activations as act
    from mimo_sft.testing import saved_bytes as sb

    rows = []
    for kind, label in layer_kinds(d):
        for name, rc in SETTINGS.items():
            block, cfg = sb.language_layer(hf_dir, dtype=dtype, recompute=rc, layer_type=kind)
            measured = sb.language_layer_saved(block, cfg, tokens, dtype=dtype)
            forecast = _forecast(d, rc, tp=1, sp=False, b=b, layer_type=kind)
            rows.append((f"decoder layer{label}, {name}", "token", forecast, measured / tokens))
            if rc is None:
                cuda = sb.language_layer_saved(block, cfg, tokens, dtype=dtype, device="cuda")
                rows.append((f"decoder layer{label}, {name}, CUDA's RMSNorm (derived)", "token",
                             _forecast(d, rc, tp=1, sp=False, b=b, layer_type=kind, device="cuda"), cuda / tokens))
                rows += _layer_parts(block, cfg, d, tokens, dtype, b, kind)
            del block
        fusion = not act.FUSED_SWIGLU
        block, cfg = sb.language_layer(hf_dir, dtype=dtype, layer_type=kind, extra={"bias_activation_fusion": fusion})
        rows.append((f"decoder layer{label}, no recompute, SwiGLU fusion {'on' if fusion else 'off'}", "token",
                     _forecast(d, None, tp=1, sp=False, b=b, layer_type=kind, swiglu_fused=fusion),
                     sb.language_layer_saved(block, cfg, tokens, dtype=dtype) / tokens))
    return rows


def _layer_parts(block, cfg, d, tokens, dtype, b, kind):
    """The token mixer (attention or GDN) and MLP halves of the layer alone, against their terms."""
    import torch

    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from mimo_sft.memory import activations as act
    from mimo_sft.testing import saved_bytes as sb

    layer = block.layers[0]
    terms = act.language_layer_terms(d, tp=1, sp=False, b=b, layer_type=kind, device="cpu", index=0)
    rope = MultimodalRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=block.rotary_percent)
    emb = rope(torch.arange(tokens).view(1, 1, tokens).expand(3, 1, tokens), cfg.mrope_section)
    x = torch.randn(tokens, 1, d.hidden, dtype=dtype, requires_grad=True)
    params = list(layer.parameters())
    with sb.flash_sdpa(), sb.fla_saved_tensors(layer):
        mixer, _ = sb.saved_bytes(lambda t: layer.self_attention(t, None, rotary_pos_emb=emb), x, exclude=params + [emb])
        mlp, _ = sb.saved_bytes(layer.mlp, x, exclude=params)
    half = terms["linear inputs"] / 2
    mixer_terms = [t for t in terms if t not in ("norms", "linear inputs") + MLP_TERMS]
    label = " + ".join(mixer_terms) if len(mixer_terms) <= 4 else "its terms"
    return [(f"  token mixer part ({label} + its input)", "token",
             half + sum(terms[t] for t in mixer_terms), mixer / tokens),
            ("  MLP part (mlp, or router + experts, + its input)", "token",
             half + sum(terms.get(t, 0) for t in MLP_TERMS), mlp / tokens)]


def vision_rows(hf_dir, v, patches, dtype, b):
    import torch

    from mimo_sft.memory import activations as act
    from mimo_sft.testing import saved_bytes as sb

    block, vcfg = sb.vision_block(hf_dir, dtype=dtype)
    full = sum(act.vision_block_terms(v, b=b).values())
    rows = [("vision block, full attention", "patch", full, sb.vision_block_saved(block, vcfg, patches, dtype=dtype) / patches),
            ("vision block, windows of 64 patches", "patch", full,
             sb.vision_block_saved(block, vcfg, patches, dtype=dtype, window=64) / patches),
            ("vision block, --recompute-vision", "patch", act.vision_block_input(v, b=b),
             sb.vision_block_saved(block, vcfg, patches, dtype=dtype, recompute=True) / patches)]
    windows, images = sb.image_segments(vcfg, PAGES)
    for what, segments in (("windows", windows), ("images", images)):
        if what == "windows" and windows == images:
            continue  # a tower without windows
        n = sum(images)
        label = f"vision block, {len(images) - 1} pages of 42 x 30 patches and one of 16 x 20, attention per {what[:-1]}"
        rows.append((label, "patch", full, sb.vision_block_saved(block, vcfg, n, dtype=dtype, segments=segments) / n))
    measured = 0
    x = torch.randn(patches, v.hidden, dtype=dtype, requires_grad=True)
    for j, merger in enumerate(sb.projector_modules(hf_dir, dtype=dtype)):
        # the main merger's input is the last block's output, kept by it alone; a DeepStack merger's is a
        # block output the next block keeps anyway (counted there)
        kept, _ = sb.saved_bytes(merger, x, exclude=list(merger.parameters()) + ([x] if j else []))
        measured += kept
    rows.append(("patch merger" + (f" + {v.deepstack} DeepStack mergers" if v.deepstack else ""), "patch",
                 act.merger_terms(v, b=b), measured / patches))
    return rows


def cross_entropy_row(d, tokens, dtype, b):
    """megatron's vocab-parallel cross entropy (tp 1) on this vocabulary: what it keeps for backward
    (the fp32 softmax, plus the int64 target and bool mask: 9 bytes a token)."""
    import torch
    from megatron.core import tensor_parallel

    from mimo_sft.memory import activations as act
    from mimo_sft.parallel.bootstrap import start_single_process
    from mimo_sft.testing import saved_bytes as sb

    state = start_single_process("cpu")
    vocab = d.padded_vocab(1)
    logits = torch.randn(tokens, 1, vocab, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, d.vocab, (tokens, 1))
    measured, _ = sb.saved_bytes(tensor_parallel.vocab_parallel_cross_entropy, logits, labels,
                                 tp_group=state.modules["language"].pg_collection.tp)
    saved = act.FP32 * vocab  # the forecast's "cross entropy" term also holds the bf16 logits beside it
    return [("cross entropy, saved softmax (fp32)", "token", saved, measured / tokens)]


def _tp_worker(rank, tp, port, hf_dir, tokens, dtype_name, queue):
    """One of ``tp`` gloo ranks: a ``language=tp=N`` layout's decoder layer with and without sequence
    parallelism (and full recomputation), this rank's saved bytes against the forecast's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import TextDims
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.bootstrap import start_world
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.parallel.layout import Layout
    from mimo_sft.testing import saved_bytes as sb

    start_world(timeout_s=300)
    pstate = build_parallel_state(Layout.from_specs([parse_component(f"language=tp={tp},dp=1")]))
    runtime.init_megatron(0, tp_rank=rank)
    dtype = getattr(torch, dtype_name)
    b = 2 if dtype == torch.bfloat16 else 4
    d = TextDims.from_config(read_hf_config(hf_dir))
    rows = []
    for kind, label in layer_kinds(d):
        for sp in (False, True):
            for name, rc in (("no recompute", None), ("full", SETTINGS["full (uniform, 1 layer)"])):
                try:
                    block, cfg = sb.language_layer(hf_dir, dtype=dtype, recompute=rc, pstate=pstate,
                                                   extra={"sequence_parallel": sp}, layer_type=kind)
                except AssertionError as err:  # a norm without sequence parallelism (megatron's WrappedTorchNorm)
                    rows.append((f"decoder layer{label} tp {tp}{', SP' if sp else ''}, {name}: not built ({err})",
                                 "token", 0, 0))
                    continue
                for device in ("cpu", "cuda") if rc is None else ("cpu",):
                    measured = sb.language_layer_saved(block, cfg, tokens, dtype=dtype, device=device)
                    forecast = _forecast(d, rc, tp=tp, sp=sp, b=b, layer_type=kind, device=device)
                    where = ", CUDA's RMSNorm (derived)" if device == "cuda" else ""
                    rows.append((f"decoder layer{label} tp {tp}{', sequence parallel' if sp else ''}, {name}{where} "
                                 f"(per rank)", "token", forecast, measured / tokens))
    if rank == 0:
        queue.put(rows)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def tp_rows(hf_dir, tp, tokens, dtype_name):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_worker, args=(r, tp, port, hf_dir, tokens, dtype_name, queue)) for r in range(tp)]
    for proc in procs:
        proc.start()
    try:
        rows = queue.get(timeout=900)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-vl-7b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--patches", type=int, default=1024)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--tp", type=int, default=2, help="also measure one layer on this many gloo ranks, "
                   "with and without sequence parallelism (1: skip)")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import TextDims, VisionDims
    from mimo_sft.testing.tiny_checkpoint import preset_config

    dtype, b = (torch.bfloat16, 2) if a.dtype == "bf16" else (torch.float32, 4)
    with tempfile.TemporaryDirectory() as tmp:
        preset_config(a.preset).save_pretrained(tmp)
        hf = read_hf_config(tmp)
        d, v = TextDims.from_config(hf), VisionDims.from_config(hf)
        rows = language_rows(tmp, d, a.tokens, dtype, b) + vision_rows(tmp, v, a.patches, dtype, b)
        rows += cross_entropy_row(d, a.tokens, dtype, b)
        if a.tp > 1:
            rows += tp_rows(tmp, a.tp, a.tokens, str(dtype).split(".")[1])
    print(f"{a.preset}, {a.dtype}: language hidden {d.hidden}, {a.tokens} tokens; vision hidden {v.hidden}, "
          f"{a.patches} patches (bytes per token / patch; hidden multiples in brackets)")
    print(f"| {'what':<{NAME}} | {'per':<5} | {'forecast':>18} | {'measured':>18} | {'ratio':>6} |")
    print(f"|{'-' * (NAME + 2)}|{'-' * 7}|{'-' * 20}|{'-' * 20}|{'-' * 8}|")
    for name, per, forecast, measured in rows:
        width = d.hidden if per == "token" else v.hidden
        if not measured:
            print(f"| {name} |")
            continue
        print(f"| {name:<{NAME}} | {per:<5} | {forecast:>9,.0f} ({forecast / width:5.1f}h) | "
              f"{measured:>9,.0f} ({measured / width:5.1f}h) | {forecast / measured if measured else float('nan'):6.3f} |")
    if d.layer_types:
        print(f"(hybrid decoder: the measured layers also keep each zero-centred RMSNorm's fp32 1 + w, per layer and "
              f"not per token, {4 * 2 * d.hidden / a.tokens:.0f} bytes a token here, and attention's q/k norms "
              f"{4 * 2 * d.head_dim / a.tokens:.0f} more; selective core_attn a 4-byte mask-type tensor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
