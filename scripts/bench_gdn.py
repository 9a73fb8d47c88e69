#!/usr/bin/env python
"""CPU time of one GatedDeltaNet mixing (conv + q/k L2 norm + chunked gated delta rule), ours vs transformers'.

    python scripts/bench_gdn.py [--quick] [--repeats 2] [--threads 2]

Why: on the CPU megatron's GatedDeltaNet runs ``mimo_sft.model.gdn_kernels`` (fla is GPU only). The
reference is transformers' torch path for the same layer (``causal_conv1d_fn`` then
``torch_chunk_gated_delta_rule``), which cannot keep packed samples apart: for the packed case it runs
once per segment. Both sides get the same inputs and do the same work: convolution with silu over the
q/k/v channels, split, L2 norm of q and k, key heads repeated to the value heads, the delta rule; then
a backward from a scalar loss.

Sizes are Qwen3.5-27B's linear attention (16 key heads x 128, 48 value heads x 128, conv width 4: a
conv over 2*16*128 + 48*128 = 10240 channels), batch 1; the hidden 5120 only sizes the projections,
which are not part of the kernel. ``--quick`` shrinks heads and lengths for a smoke run. Times are CPU
seconds (``time.process_time``, all threads) of the fastest of ``--repeats`` runs: on a shared machine
wall time varies far more than a process's own CPU time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FULL = dict(key_heads=16, value_heads=48, head_dim=128, width=4, cases=[("1024", [1024]), ("4096", [4096]),
                                                                       ("4 packed (4096)", [1536, 1024, 1024, 512])])
QUICK = dict(key_heads=2, value_heads=6, head_dim=32, width=4, cases=[("128", [128]), ("512", [512]),
                                                                     ("4 packed (512)", [200, 130, 118, 64])])


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


def ours(inputs, lengths, dims):
    """As megatron's GatedDeltaNet calls the kernels: q/k normed, then repeated, then the rule."""
    from mimo_sft.model.gdn_kernels import causal_conv1d, chunk_gated_delta_rule, l2norm

    x, w, g, beta = inputs
    cu = torch.tensor([0] + lengths).cumsum(0) if len(lengths) > 1 else None
    y, _ = causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
    q, k, v = split_heads(y, dims)
    rep = dims["value_heads"] // dims["key_heads"]
    q, k = (l2norm(t).repeat_interleave(rep, dim=2) for t in (q, k))
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    return out


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


def cpu_seconds(fn, inputs, repeats: int) -> float:
    """Fastest forward+backward, in CPU seconds of this process."""
    best = math.inf
    for _ in range(repeats):
        for t in inputs:
            t.grad = None
        start = time.process_time()
        fn().float().square().mean().backward()
        best = min(best, time.process_time() - start)
    return best


def max_rel_diff(inputs, lengths, dims) -> float:
    """Our output against transformers' (a sanity column: both sides computed the same thing)."""
    with torch.no_grad():
        a, b = ours(inputs, lengths, dims).float(), theirs(inputs, lengths, dims).float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def run(dims, repeats: int) -> list[tuple]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, lengths in dims["cases"]:
            inputs = make_inputs(dims, sum(lengths), dtype)
            t_ours = cpu_seconds(lambda: ours(inputs, lengths, dims), inputs, repeats)
            t_theirs = cpu_seconds(lambda: theirs(inputs, lengths, dims), inputs, repeats)
            rows.append((str(dtype).replace("torch.", ""), name, t_ours, t_theirs, max_rel_diff(inputs, lengths, dims)))
    return rows


def print_table(rows, dims, threads: int) -> None:
    head = (f"GDN mixing fwd+bwd, CPU s ({threads} threads), {dims['key_heads']}x{dims['head_dim']} key heads, "
            f"{dims['value_heads']}x{dims['head_dim']} value heads, batch 1")
    print(head)
    print(f"{'dtype':<9}{'tokens':<18}{'ours':>9}{'transformers':>14}{'speed-up':>10}{'max rel diff':>14}")
    for dtype, name, a, b, diff in rows:
        print(f"{dtype:<9}{name:<18}{a:>9.2f}{b:>14.2f}{b / a:>9.2f}x{diff:>14.1e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small heads and lengths (smoke run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import mimo_sft.parallel  # noqa: F401  (before anything imports megatron)
    import transformers

    transformers.logging.set_verbosity_error()  # its "falling back to the torch path" notice, once per function
    dims = QUICK if args.quick else FULL
    print_table(run(dims, args.repeats), dims, args.threads)


if __name__ == "__main__":
    main()
