#!/usr/bin/env python
"""Attention calls and time before/after issue 23's one-call attention: the table in docs/benchmarks.md.

    python scripts/bench_attention.py [--preset qwen2.5-vl-7b] [--page-mpx 2] [--blocks 2] [--samples 16]

Vision: the preset's real-width Qwen2.5-VL tower (1280 wide, 16 heads) on one document page of
``--page-mpx`` megapixels (aspect 1:1.41, resized as the processor does). ``before`` is transformers'
own tower with its ``sdpa`` path (one SDPA call per window or image); ``after`` is mimo-sft's encoder
with ``model.vision_attention`` (one call per block). SDPA calls are counted with ``torch.profiler``
on one windowed block and one full-attention block, then scaled to the preset's depth (its number of
windowed and full blocks); forward+backward CPU time (one thread) is measured on a tower of ``--blocks``
real-width blocks (the last one full attention), fp32.

Language: one packed micro-batch of ``--samples`` samples (seeded lengths) through the language
core at the preset's real head layout: ``before`` the per-sample loop the core ran until issue 23
(one SDPA call per sample, reproduced here), ``after`` ``model.attention.SDPAttention`` (one call per
layer). Calls are counted per layer and scaled to the preset's depth; the attention FLOPs of the
padded batch against the sum over samples show what the one call costs.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import profile  # noqa: E402


def sdpa_calls(fn) -> int:
    with torch.no_grad(), profile() as prof:
        fn()
    return sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())


def fwd_bwd_seconds(fn, params, repeats: int) -> float:
    """CPU seconds (``time.process_time``, one thread) of the fastest of ``repeats`` forward+backward
    passes: on a machine shared with other work, wall time varies by 2x between identical runs, the
    process's own CPU time by a few percent."""
    best = math.inf
    for _ in range(repeats):
        for p in params:
            p.grad = None
        start = time.process_time()
        out = fn()
        out.float().square().mean().backward()
        best = min(best, time.process_time() - start)
    return best


# ---- vision ---------------------------------------------------------------------------------------
def page_grid(vcfg, mpx: float) -> torch.Tensor:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    width = math.sqrt(mpx * 1e6 / 1.41)
    factor = vcfg.patch_size * vcfg.spatial_merge_size
    h, w = smart_resize(int(width * 1.41), int(width), factor=factor, max_pixels=int(16 * 1e6))
    return torch.tensor([[1, h // vcfg.patch_size, w // vcfg.patch_size]])


def towers(vcfg, depth: int, full: list[int]):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from mimo_sft.model.qwen2_5_vl import Qwen25VisionEncoder
    from mimo_sft.model.vision_attention import SEGMENT_ATTENTION

    base = copy.deepcopy(vcfg)
    base.depth, base.fullatt_block_indexes = depth, full
    before_cfg, after_cfg = copy.deepcopy(base), copy.deepcopy(base)
    before_cfg._attn_implementation, after_cfg._attn_implementation = "sdpa", SEGMENT_ATTENTION
    torch.manual_seed(0)
    before = Qwen2_5_VisionTransformerPretrainedModel(before_cfg).float()
    after = Qwen25VisionEncoder(after_cfg).float()
    after.load_state_dict(before.state_dict())
    return before, after


def vision_rows(vcfg, args) -> list[tuple]:
    grid = page_grid(vcfg, args.page_mpx)
    patches = int(grid.prod())
    x = torch.randn(patches, vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2)
    depth, n_full = vcfg.depth, len(vcfg.fullatt_block_indexes)
    counts = {}
    for kind, full in (("windowed", []), ("full", [0])):
        before, after = towers(vcfg, 1, full)
        counts[kind] = (sdpa_calls(lambda: before(hidden_states=x, grid_thw=grid)), sdpa_calls(lambda: after(x, grid)))
        del before, after
    per_forward = [(depth - n_full) * counts["windowed"][i] + n_full * counts["full"][i] for i in (0, 1)]
    h, w = int(grid[0, 1]) * vcfg.patch_size, int(grid[0, 2]) * vcfg.patch_size
    page = f"{h}x{w} px page, {patches:,} patches"
    rows = [(f"vision, one windowed block ({page})", *counts["windowed"]),
            ("vision, one full-attention block", *counts["full"]),
            (f"vision tower forward ({depth - n_full} windowed + {n_full} full blocks)", *per_forward)]
    before, after = towers(vcfg, args.blocks, [args.blocks - 1])
    times = [fwd_bwd_seconds(lambda: before(hidden_states=x, grid_thw=grid).pooler_output,
                             list(before.parameters()), args.repeats),
             fwd_bwd_seconds(lambda: after(x, grid), list(after.parameters()), args.repeats)]
    timing = (f"vision fwd+bwd CPU s (1 thread), {args.blocks} real-width blocks (last full), fp32", *[f"{t:.2f}" for t in times])
    return rows, timing


# ---- language -------------------------------------------------------------------------------------
def per_sample_loop(core, query, key, value, bounds):
    """The packed core as it was before issue 23: one causal SDPA call per ``cu_seqlens`` segment."""
    import torch.nn.functional as F

    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=core.scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, dim=0).reshape(query.shape[0], -1)


def language_rows(tcfg, args):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mimo_sft.model.attention import SDPAttention
    from mimo_sft.model.segments import segments_of
    from mimo_sft.parallel.bootstrap import start_single_process

    state = start_single_process(prefer="cpu")
    heads, groups = tcfg.num_attention_heads, tcfg.num_key_value_heads
    d = tcfg.hidden_size // heads
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=d, attention_dropout=0.0, use_cpu_initialization=True,
                            variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    core = SDPAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        pg_collection=state.modules["language"].pg_collection)
    lengths = torch.randint(64, args.max_len + 1, (args.samples,), generator=torch.Generator().manual_seed(0)).tolist()
    bounds = [0] + torch.cumsum(torch.tensor(lengths), 0).tolist()
    cu = torch.tensor(bounds, dtype=torch.int32)
    total = bounds[-1]
    q = torch.randn(total, heads, d, requires_grad=True)
    k, v = (torch.randn(total, groups, d, requires_grad=True) for _ in range(2))

    def params():
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                               max_seqlen_kv=max(lengths))

    run_before = lambda: per_sample_loop(core, q, k, v, bounds)  # noqa: E731
    run_after = lambda: core(q, k, v, None, packed_seq_params=params())  # noqa: E731
    torch.testing.assert_close(run_after(), run_before(), rtol=1e-5, atol=1e-5)
    calls = (sdpa_calls(run_before), sdpa_calls(run_after))
    layers = tcfg.num_hidden_layers
    batch = segments_of(cu)
    flops = sum(n * n for n in lengths), sum(g.count * g.width ** 2 for g in batch.groups)
    label = f"{args.samples} samples, {total:,} tokens, {heads}/{groups} heads"
    rows = [(f"language, one packed layer ({label})", *calls),
            (f"language forward ({layers} layers)", calls[0] * layers, calls[1] * layers),
            ("language attention score entries (sum L^2 vs the groups' count x width^2)", f"{flops[0]:,}",
             f"{flops[1]:,}")]
    times = [fwd_bwd_seconds(run_before, [q, k, v], args.repeats), fwd_bwd_seconds(run_after, [q, k, v], args.repeats)]
    timing = ("language core fwd+bwd CPU s (1 thread), one layer, fp32", *[f"{t:.3f}" for t in times])
    return rows, timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-vl-7b")
    ap.add_argument("--page-mpx", type=float, default=2.0, help="page size in megapixels")
    ap.add_argument("--blocks", type=int, default=2, help="real-width vision blocks for the timing (last: full)")
    ap.add_argument("--samples", type=int, default=16, help="samples in the packed language micro-batch")
    ap.add_argument("--max-len", type=int, default=1024, help="longest packed sample (lengths uniform in [64, max])")
    ap.add_argument("--repeats", type=int, default=2, help="timed forward+backward passes (the fastest is shown)")
    ap.add_argument("--part", choices=("all", "vision", "language"), default="all", help="which rows to measure")
    args = ap.parse_args()

    from mimo_sft.testing.tiny_checkpoint import preset_config

    torch.set_num_threads(1)  # process CPU time is the measure (fwd_bwd_seconds)
    cfg = preset_config(args.preset)
    rows = []
    if args.part in ("all", "vision"):
        vision, vision_time = vision_rows(cfg.vision_config, args)
        rows += vision + [vision_time]
    if args.part in ("all", "language"):
        language, language_time = language_rows(cfg.text_config, args)
        rows += language + [language_time]
    wide = max(len(r[0]) for r in rows)
    print(f"{args.preset} · SDPA calls (torch.profiler) and CPU time, before/after the one-call attention")
    print(f"| {'what':<{wide}} | {'before':>12} | {'after':>12} |")
    print(f"|{'-' * (wide + 2)}|{'-' * 14}|{'-' * 14}|")
    for what, before, after in rows:
        b = f"{before:,}" if isinstance(before, int) else before
        a = f"{after:,}" if isinstance(after, int) else after
        print(f"| {what:<{wide}} | {b:>12} | {a:>12} |")


if __name__ == "__main__":
    main()
