"""fla's Gated DeltaNet kernels against mimo-sft's torch kernels on identical inputs (a GPU check).

Why: which kernels a run takes is ``mimo_sft.gdn_path``'s rule (fla where it is installed and correct on a
CUDA GPU, the torch kernels of ``mimo_sft.model.gdn_kernels`` elsewhere), tested on the CPU by its rule
only; the CPU tests prove the torch kernels against transformers. Here the GPU measures fla's
``causal_conv1d`` and ``chunk_gated_delta_rule`` against the torch kernels on packed rows, forward and
backward, bf16 inputs at Qwen3.5-0.8B's linear-attention width, fla called two ways: as a run calls it
(host ``cu_seqlens``, which megatron hands on, through ``model.gdn_binding``'s device copy) and with a
device ``cu_seqlens`` directly. Prints this machine's rule line and a table of max relative differences.

Exit status: 0 when every row was measured; 1 when something was not: no CUDA device or no fla (nothing
measured), or fla refusing its backward (Hopper with triton 3.4.0 to 3.7.0 and no usable tilelang: the
rule's torch case; the forward rows are still printed). No tolerance is asserted: no GPU figure has
been recorded yet.

    python scripts/check_gdn_fla.py [--tokens 4096] [--segments 4]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

NAMES = ("x", "w", "q", "k", "v", "g", "beta")
ROWS = ("conv out", "rule out", *(f"d {n}" for n in NAMES))


def make_inputs(tokens: int, segments: int, heads: int, dk: int, dv: int, device) -> dict:
    """bf16 leaves (fp32 ``g``), and the segment bounds on the host (``cu``, int32 as packing makes them)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cuts = sorted(torch.randperm(tokens - 1, generator=g)[: segments - 1].add(1).tolist())
    cu = torch.tensor([0, *cuts, tokens], dtype=torch.int32)

    def leaf(t, dtype=torch.bfloat16):
        return t.to(device, dtype).requires_grad_(True)

    q = torch.nn.functional.normalize(torch.randn(1, tokens, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, heads, dk, generator=g), dim=-1)
    channels = 2 * heads * dk + heads * dv
    return dict(q=leaf(q), k=leaf(k), v=leaf(torch.randn(1, tokens, heads, dv, generator=g)),
                g=leaf(-torch.rand(1, tokens, heads, generator=g), torch.float32),
                beta=leaf(torch.rand(1, tokens, heads, generator=g)), x=leaf(torch.randn(1, tokens, channels, generator=g)),
                w=leaf(0.5 * torch.randn(channels, 4, generator=g)), cu=cu)


def run_side(conv, rule, t: dict, cu) -> tuple[list, str | None]:
    """Outputs and the gradient of every input (None where the backward raised, with its message)."""
    y, _ = conv(x=t["x"], weight=t["w"], activation="silu", cu_seqlens=cu)
    o, _ = rule(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], cu_seqlens=cu)
    refused = None
    try:
        (y.float().square().mean() + o.float().square().mean()).backward()
        grads = [t[n].grad.clone() for n in NAMES]
    except RuntimeError as err:  # fla's refusal on Hopper with triton 3.4.0 to 3.7.0
        refused, grads = str(err).splitlines()[0], [None] * len(NAMES)
    for n in NAMES:
        t[n].grad = None
    return [y.detach(), o.detach(), *grads], refused


def rel(a, b) -> float | None:
    if a is None or b is None:
        return None
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def compare(torch_side, fla_sides: dict, t: dict) -> tuple[dict, list[str]]:
    """``{column: [max rel diff per row, None where not measured]}`` of each fla side against the torch
    kernels (``fla_sides``: name -> (conv, rule, cu_seqlens)), the first two fla sides against each other,
    and the refusals seen."""
    device_cu = t["cu"].to(t["x"].device)
    reference, _ = run_side(*torch_side, t, device_cu)
    results, refusals = {}, []
    for name, (conv, rule, cu) in fla_sides.items():
        results[name], refused = run_side(conv, rule, t, cu)
        refusals += [f"{name}: {refused}"] if refused else []
    columns = {f"{name} vs torch": [rel(a, b) for a, b in zip(out, reference)] for name, out in results.items()}
    first, second = list(results.values())[:2]
    columns["host vs device cu_seqlens"] = [rel(a, b) for a, b in zip(first, second)]
    return columns, refusals


def print_table(columns: dict) -> None:
    print(f"{'tensor':<10}" + "".join(f"{c:>28}" for c in columns))
    for i, row in enumerate(ROWS):
        cells = ("not measured" if col[i] is None else f"{col[i]:.2e}" for col in columns.values())
        print(f"{row:<10}" + "".join(f"{c:>28}" for c in cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--segments", type=int, default=4)
    a = p.parse_args(argv)
    from mimo_sft.gdn_path import local_choice

    print(f"check_gdn_fla: this machine: {local_choice().line()}")
    if not torch.cuda.is_available():
        print("check_gdn_fla: no CUDA device: nothing measured (fla's kernels are triton, GPU only)")
        return 1
    try:
        from fla.modules.convolution import causal_conv1d as fla_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError as err:
        print(f"check_gdn_fla: fla is not importable ({err}); install mimo-sft[gpu]. Nothing measured")
        return 1
    from mimo_sft.model.gdn_binding import _with_device_bounds
    from mimo_sft.model.gdn_kernels import causal_conv1d, chunk_gated_delta_rule

    t = make_inputs(a.tokens, a.segments, heads=16, dk=128, dv=128, device="cuda")  # Qwen3.5-0.8B's GDN width
    sides = {"fla, host cu_seqlens": (_with_device_bounds(fla_conv), _with_device_bounds(fla_rule), t["cu"]),
             "fla, device cu_seqlens": (fla_conv, fla_rule, t["cu"].cuda())}
    columns, refusals = compare((causal_conv1d, chunk_gated_delta_rule), sides, t)
    print(f"fla vs the torch kernels, bf16, {a.tokens} tokens in {a.segments} packed segments; max rel diff")
    print_table(columns)
    for line in refusals:
        print(f"check_gdn_fla: fla's backward refused ({line}): the gradient rows are not measured")
    return 1 if refusals else 0


if __name__ == "__main__":
    sys.exit(main())
