#!/usr/bin/env python
"""A long clip on a tower replicated over tp ranks, at real width on the CPU: what one replica keeps for backward
and computes when it encodes the whole clip (before ``train/tower_split.py``) and its share of it (after), and
the bytes the all-gather of the embeddings moves (the table in docs/benchmarks.md).

    python scripts/bench_tower_split.py [--preset qwen2.5-vl-7b] [--side 448] [--temporal-patches 32] [--tp 1,2,4]

One vision block of the preset (transformers' block, training's segment attention, torch's flash SDPA kernel as
on a GPU; ``testing.saved_bytes``) runs on the patches one replica encodes: the clip's ``--temporal-patches``
frame groups of ``(side / 14)^2`` patches each, split into contiguous shares (``tower_split.shares``). Printed per
tp: the replica's patches, autograd's saved bytes for one full-attention block and one windowed block (Qwen2.5-VL;
attention per frame group as the tower runs it), those over the tower's depth, the block's forward + backward
wall time on this CPU, and the embeddings a replica receives from the others (``out_hidden * b`` per merged
token: a formula, counted exactly). Saved bytes are measured; the times are CPU times, not a GPU's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1024 ** 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-vl-7b")
    p.add_argument("--side", type=int, default=448, help="each frame's resized side in pixels")
    p.add_argument("--temporal-patches", type=int, default=32, help="the clip's frame groups (64 frames at 2 each)")
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import VisionDims
    from mimo_sft.testing import saved_bytes as sb
    from mimo_sft.testing.tiny_checkpoint import preset_config
    from mimo_sft.train.tower_split import shares

    dtype, b = (torch.bfloat16, 2) if a.dtype == "bf16" else (torch.float32, 4)
    with tempfile.TemporaryDirectory() as tmp:
        preset_config(a.preset).save_pretrained(tmp)
        v = VisionDims.from_config(read_hf_config(tmp))
        block, vcfg = sb.vision_block(tmp, dtype=dtype)
        side = a.side // v.patch
        per_unit = side * side
        units = [per_unit] * a.temporal_patches
        rows = []
        for tp in [int(x) for x in a.tp.split(",")]:
            bounds = shares([float(u) for u in units], tp)
            mine = max(bounds[r + 1] - bounds[r] for r in range(tp))  # the busiest replica's frame groups
            patches = mine * per_unit
            grids = [[1, side, side]] * mine
            windows, frames = sb.image_segments(vcfg, grids)
            full = sb.vision_block_saved(block, vcfg, patches, dtype=dtype, segments=frames)
            windowed = sb.vision_block_saved(block, vcfg, patches, dtype=dtype, segments=windows)
            tower = v.full_attention_blocks * full + (v.depth - v.full_attention_blocks) * windowed
            x = torch.randn(patches, vcfg.hidden_size, dtype=dtype, requires_grad=True)
            angles = torch.randn(patches, vcfg.hidden_size // vcfg.num_heads // 2)
            emb = torch.cat([angles, angles], dim=-1)
            cu = torch.tensor([0, *torch.tensor(frames).cumsum(0).tolist()], dtype=torch.int32)
            with sb.flash_sdpa():
                start = time.perf_counter()
                block(x, cu_seqlens=cu, position_embeddings=(emb.cos(), emb.sin())).float().sum().backward()
                seconds = time.perf_counter() - start
            received = (a.temporal_patches - mine) * per_unit // v.merge ** 2 * v.out_hidden * (1 + v.deepstack) * b
            rows.append((tp, mine, patches, full, windowed, tower, seconds, received))
    base = rows[0][5]
    print(f"{a.preset}, {a.dtype}: a clip of {a.temporal_patches} frame groups of {side} x {side} patches "
          f"({a.temporal_patches * per_unit:,} patches); vision hidden {v.hidden}, depth {v.depth} "
          f"({v.full_attention_blocks} full-attention blocks)")
    print("| images tp | frame groups per replica | patches | saved, full block (MiB) | saved, windowed block (MiB) "
          "| saved, whole tower (MiB) | vs tp 1 | block fwd+bwd (s, CPU) | embeddings received (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp, mine, patches, full, windowed, tower, seconds, received in rows:
        print(f"| {tp} | {mine} | {patches:,} | {full / MIB:,.1f} | {windowed / MIB:,.1f} | {tower / MIB:,.0f} | "
              f"{tower / base:.2f}x | {seconds:.2f} | {received / MIB:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
