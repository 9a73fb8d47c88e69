"""torch's variable-length attention against the padded SDPA path, on a GPU (a ``gpu_check.sh`` stage).

``--attention-backend auto`` runs packed attention (the language model's in-batch packing, the vision tower's
windows and images) through ``torch.nn.attention.varlen`` where it runs: one flash call per layer on the packed
tensors, no padding. The padded SDPA path (``model.segments``, ``--attention-backend sdpa``) is what CPU tests
check against each segment attended alone; this script checks the variable-length kernel against it where both
run, in bf16, causal and not, with grouped-query attention (28 query heads over 4 KV heads, as Qwen2.5-VL-7B),
forward and every input's gradient, and times both.

    python scripts/check_varlen.py [--tolerance 0.02]

Exit 0: every comparison within the tolerance (relative to the largest reference value); 1: one is not;
3: nothing was measured (no CUDA device, or a torch without ``torch.nn.attention.varlen``) -- never a pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: packed micro-batches: (segment lengths, query heads, KV heads, head dim)
CASES = (([512, 2048, 37, 1100, 8], 28, 4, 128),  # language rows: long-tailed, GQA
         ([64] * 200 + [40] * 12, 16, 16, 80),   # vision windows: equal, head dim 80 (Qwen2.5-VL's tower)
         ([4096, 4096], 16, 2, 128))


def _time(fn, repeats: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def compare(lengths, heads, kv_heads, head_dim, causal: bool) -> dict:
    import torch

    from mimo_sft.model.segments import SegmentBatch, use_kernel

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(total, kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    weight = torch.randn(total, heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    results = {}
    for kind in ("sdpa", "varlen"):
        use_kernel(kind)
        batch = SegmentBatch(lengths, device)
        out = batch.attend(q, k, v, causal=causal, scale=head_dim ** -0.5)
        grads = torch.autograd.grad((out.float() * weight.float()).sum(), (q, k, v))
        seconds = _time(lambda: torch.autograd.grad(
            (batch.attend(q, k, v, causal=causal, scale=head_dim ** -0.5).float() * weight.float()).sum(), (q, k, v)))
        results[kind] = (out.detach().float(), [x.float() for x in grads], seconds)
    use_kernel("auto")
    ref_out, ref_grads, ref_s = results["sdpa"]
    out, grads, s = results["varlen"]
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))  # noqa: E731
    return {"forward": rel(out, ref_out), "grads": max(rel(a, b) for a, b in zip(grads, ref_grads)),
            "sdpa_ms": 1e3 * ref_s, "varlen_ms": 1e3 * s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=0.02)
    args = parser.parse_args()
    import torch

    from mimo_sft.model.segments import varlen_function

    if not torch.cuda.is_available() or varlen_function() is None:
        print(f"check_varlen: nothing measured (CUDA available: {torch.cuda.is_available()}, "
              f"torch.nn.attention.varlen: {varlen_function() is not None})")
        return 3
    worst = 0.0
    print("| segments | heads/kv | causal | forward rel | grad rel | sdpa fwd+bwd ms | varlen fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|")
    for lengths, heads, kv, dim in CASES:
        for causal in (True, False):
            r = compare(lengths, heads, kv, dim, causal)
            worst = max(worst, r["forward"], r["grads"])
            print(f"| {len(lengths)} ({sum(lengths)} tokens) | {heads}/{kv} d{dim} | {causal} | {r['forward']:.2e} | "
                  f"{r['grads']:.2e} | {r['sdpa_ms']:.2f} | {r['varlen_ms']:.2f} |", flush=True)
    print(f"check_varlen: worst relative difference {worst:.2e} (tolerance {args.tolerance})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
