"""fla's Gated DeltaNet kernels against mimo-sft's torch stand-ins on identical inputs (a GPU check).

Why: on CUDA, Qwen3.5's linear-attention layers run fla's triton ``causal_conv1d`` and
``chunk_gated_delta_rule`` (``pip install .[gpu]``); the CPU tests prove the stand-ins
(``mimo_sft.model.gdn_kernels``) against transformers, so agreeing with the stand-ins on the GPU ties
fla to the same reference. Packed rows (``cu_seqlens``), forward and backward, bf16 inputs at
Qwen3.5-0.8B's linear-attention width. Prints a table; exits 0 without a GPU or without fla
(saying so: nothing is measured then).

    python scripts/check_gdn_fla.py [--tokens 4096] [--segments 4]
"""

from __future__ import annotations

import argparse
import sys

import torch


def _inputs(tokens: int, segments: int, heads: int, dk: int, dv: int, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    cuts = sorted(torch.randperm(tokens - 1, generator=g)[: segments - 1].add(1).tolist())
    cu = torch.tensor([0, *cuts, tokens], dtype=torch.int32, device=device)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device, torch.bfloat16).requires_grad_(True)

    q = torch.nn.functional.normalize(torch.randn(1, tokens, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, heads, dk, generator=g), dim=-1)
    return dict(q=q.to(device, torch.bfloat16).requires_grad_(True), k=k.to(device, torch.bfloat16).requires_grad_(True),
                v=rand(1, tokens, heads, dv), g=(-torch.rand(1, tokens, heads, generator=g)).to(device).requires_grad_(True),
                beta=torch.rand(1, tokens, heads, generator=g).to(device, torch.bfloat16).requires_grad_(True),
                x=rand(1, tokens, 2 * heads * dk + heads * dv), w=rand(2 * heads * dk + heads * dv, 4, scale=0.5),
                cu=cu)


def _run(conv, rule, t: dict) -> tuple[torch.Tensor, torch.Tensor, list]:
    y, _ = conv(x=t["x"], weight=t["w"], activation="silu", cu_seqlens=t["cu"])
    o, _ = rule(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], cu_seqlens=t["cu"])
    (y.float().square().mean() + o.float().square().mean()).backward()
    grads = [t[n].grad.clone() for n in ("x", "w", "q", "k", "v", "g", "beta")]
    for n in ("x", "w", "q", "k", "v", "g", "beta"):
        t[n].grad = None
    return y.detach(), o.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--segments", type=int, default=4)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_gdn_fla: no CUDA device; nothing measured")
        return 0
    try:
        from fla.modules.convolution import causal_conv1d as fla_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError as err:
        print(f"check_gdn_fla: fla is not importable ({err}); install mimo-sft[gpu]. Nothing measured")
        return 0
    from mimo_sft.model.gdn_kernels import causal_conv1d, chunk_gated_delta_rule

    t = _inputs(a.tokens, a.segments, heads=16, dk=128, dv=128, device="cuda")  # Qwen3.5-0.8B's GDN width
    ours = _run(causal_conv1d, chunk_gated_delta_rule, t)
    theirs = _run(fla_conv, fla_rule, t)
    names = ["conv out", "rule out", *(f"d {n}" for n in ("x", "conv w", "q", "k", "v", "g", "beta"))]
    pairs = [ours[0], ours[1], *ours[2]], [theirs[0], theirs[1], *theirs[2]]
    print(f"fla vs stand-ins, bf16, {a.tokens} tokens in {a.segments} packed segments (cu_seqlens)")
    print(f"{'tensor':<10} {'max rel diff':>14}")
    for name, x, y in zip(names, *pairs):
        print(f"{name:<10} {_rel(x, y):>14.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
