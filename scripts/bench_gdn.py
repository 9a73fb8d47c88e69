#!/usr/bin/env python
"""CPU time of one GatedDeltaNet mixing (conv + q/k L2 norm + chunked gated delta rule): mimo-sft's torch
kernels, an earlier version of them, and transformers' torch path.

    python scripts/bench_gdn.py [--quick] [--repeats 2] [--threads 2] [--baseline FILE] [--no-transformers]

Why: without fla (the CPU, and Hopper GPUs with triton 3.4.0 to 3.7.0: ``mimo_sft.gdn_path``) megatron's
GatedDeltaNet runs ``mimo_sft.model.gdn_kernels``. The reference is transformers' torch path for the same
layer (``causal_conv1d_fn`` then ``torch_chunk_gated_delta_rule``), which cannot keep packed samples
apart: for the packed cases it runs once per segment. ``--baseline FILE``: also time the kernels of a
file holding an earlier ``gdn_kernels`` (``tests/gdn_kernels_before.py``: as they were before issue 53),
each repeat right after ours, so a loaded machine slows both alike. Every side gets the same inputs and
does the same work: convolution with silu over the q/k/v channels, split, L2 norm of q and k, key heads
repeated to the value heads, the delta rule; then a backward from a scalar loss.

Sizes are Qwen3.5-27B's linear attention (16 key heads x 128, 48 value heads x 128, conv width 4: a
conv over 2*16*128 + 48*128 = 10240 channels), batch 1; the hidden 5120 only sizes the projections,
which are not part of the kernel. ``--quick`` shrinks heads and lengths for a smoke run. Times are CPU
seconds (``time.process_time``, all threads) of the fastest of ``--repeats`` runs: on a shared machine
wall time varies far more than a process's own CPU time.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: 16 packed samples of uneven lengths (none a multiple of the 64-token chunk), 4096 tokens in all
SIXTEEN = [610, 530, 470, 410, 350, 300, 270, 230, 200, 170, 150, 120, 100, 90, 60, 36]
FULL = dict(key_heads=16, value_heads=48, head_dim=128, width=4, cases=[("1024", [1024]), ("4096", [4096]),
                                                                       ("4 packed (4096)", [1536, 1024, 1024, 512]),
                                                                       ("16 packed (4096)", SIXTEEN)])
QUICK = dict(key_heads=2, value_heads=6, head_dim=32, width=4, cases=[("128", [128]), ("512", [512]),
                                                                     ("4 packed (512)", [200, 130, 118, 64]),
                                                                     ("16 packed (505)", [n // 8 for n in SIXTEEN])])


def make_inputs(dims, total: int, dtype, seed: int = 0):
    """The mixing's trainable inputs: the projected q/k/v channels, conv weight, g and beta."""
    gen = torch.Generator().manual_seed(seed)
    qk, hv, d = dims["key_heads"] * dims["head_dim"], dims["value_heads"], dims["head_dim"]
    channels = 2 * qk + hv * d
    x = torch.randn(1, total, channels, generator=gen)
    w = torch.randn(channels, dims["width"], generator=gen) / math.sqrt(dims["width"])
    g = F.logsigmoid(torch.randn(1, total, hv, generator=gen) + 4.0)
    beta = torch.rand(1, total, hv, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (x, w, g, beta)]


def split_heads(y, dims):
    """Conv output ``[1, s, channels]`` -> q, k ``[1, s, key heads, d]`` and v ``[1, s, value heads, d]``."""
    kh, hv, d = dims["key_heads"], dims["value_heads"], dims["head_dim"]
    q, k, v = torch.split(y, [kh * d, kh * d, hv * d], dim=-1)
    return q.reshape(1, -1, kh, d), k.reshape(1, -1, kh, d), v.reshape(1, -1, hv, d)


def mixing(module):
    """One GDN mixing through ``module``'s kernels, as megatron's GatedDeltaNet calls them: q/k normed, then
    repeated, then the rule; ``cu_seqlens`` a new host tensor per call, as each micro-batch's."""

    def run(inputs, lengths, dims):
        x, w, g, beta = inputs
        cu = torch.tensor([0] + lengths).cumsum(0) if len(lengths) > 1 else None
        y, _ = module.causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
        q, k, v = split_heads(y, dims)
        rep = dims["value_heads"] // dims["key_heads"]
        q, k = (module.l2norm(t).repeat_interleave(rep, dim=2) for t in (q, k))
        out, _ = module.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
        return out

    return run


def load_baseline(path: str):
    """The module in ``path`` (an earlier ``gdn_kernels``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gdn_kernels_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def theirs(inputs, lengths, dims):
    """transformers' torch path as its Qwen3-Next layer calls it (norm and head repeat inside the rule),
    one call per segment: it has no packed mode."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, torch_chunk_gated_delta_rule

    x, w, g, beta = inputs
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        y = causal_conv1d_fn(x[:, sl].transpose(1, 2), w, None, activation="silu").transpose(1, 2)
        q, k, v = split_heads(y, dims)
        outs.append(torch_chunk_gated_delta_rule(q, k, v, g[:, sl], beta[:, sl], use_qk_l2norm_in_kernel=True)[0])
        start += n
    return torch.cat(outs, dim=1)


def cpu_seconds(sides: dict, inputs, repeats: int) -> dict:
    """Fastest forward+backward of each side, in CPU seconds of this process; the sides take turns."""
    best = {name: math.inf for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            for t in inputs:
                t.grad = None
            start = time.process_time()
            fn().float().square().mean().backward()
            best[name] = min(best[name], time.process_time() - start)
    return best


def max_rel_diff(a_fn, b_fn) -> float:
    """One side's output against another's (a sanity column: both computed the same thing)."""
    with torch.no_grad():
        a, b = a_fn().float(), b_fn().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def run(dims, repeats: int, baseline=None, transformers: bool = True) -> tuple[list[str], list[tuple]]:
    """``(side names, rows)``: each row dtype, case, the sides' seconds and the max rel diff of ours against
    the baseline, else against transformers."""
    from mimo_sft.model import gdn_kernels

    kinds = {"ours": mixing(gdn_kernels)}
    if baseline is not None:
        kinds["before"] = mixing(baseline)
    if transformers:
        kinds["transformers"] = theirs
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, lengths in dims["cases"]:
            inputs = make_inputs(dims, sum(lengths), dtype)
            sides = {k: functools.partial(fn, inputs, lengths, dims) for k, fn in kinds.items()}
            seconds = cpu_seconds(sides, inputs, repeats)
            other = "before" if baseline is not None else ("transformers" if transformers else None)
            diff = max_rel_diff(sides["ours"], sides[other]) if other else float("nan")
            rows.append((str(dtype).replace("torch.", ""), name, *seconds.values(), diff))
    return list(kinds), rows


def print_table(names, rows, dims, threads: int) -> None:
    head = (f"GDN mixing fwd+bwd, CPU s ({threads} threads), {dims['key_heads']}x{dims['head_dim']} key heads, "
            f"{dims['value_heads']}x{dims['head_dim']} value heads, batch 1")
    print(head)
    ratios = [f"{n}/ours" for n in names[1:]]
    diff = "vs before" if "before" in names else "vs transformers"
    print(f"{'dtype':<9}{'tokens':<18}" + "".join(f"{n:>14}" for n in names) + "".join(f"{r:>19}" for r in ratios)
          + f"{'max rel diff ' + diff:>30}")
    for dtype, case, *cells in rows:
        times, d = cells[:-1], cells[-1]
        print(f"{dtype:<9}{case:<18}" + "".join(f"{t:>14.2f}" for t in times)
              + "".join(f"{t / times[0]:>18.2f}x" for t in times[1:]) + f"{d:>30.1e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quick", action="store_true", help="small heads and lengths (smoke run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", help="a file holding an earlier gdn_kernels, timed beside ours")
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers' torch path out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import mimo_sft.parallel  # noqa: F401  (before anything imports megatron)
    import transformers

    transformers.logging.set_verbosity_error()  # its "falling back to the torch path" notice, once per function
    dims = QUICK if args.quick else FULL
    baseline = load_baseline(args.baseline) if args.baseline else None
    names, rows = run(dims, args.repeats, baseline, transformers=not args.no_transformers)
    print_table(names, rows, dims, args.threads)


if __name__ == "__main__":
    main()
