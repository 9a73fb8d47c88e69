"""``--encoder-balance``'s exchange (``train.encoder_balance``) on two gloo ranks, with a real tiny tower.

The branches no training run of the suite reaches: float pixel rows (transformers' patches) and uint8 rows
holding a clip (``t * T`` frame rows per temporal patch) beside images; the refusal of ranks carrying rows of
different widths or dtypes; and what a rank's tower encoded (``rank_patches`` counts it, not the slice the rank
was handed). Each rank's output equals the tower run on the rank's own images, and every parameter's gradient
summed over the ranks (what DDP reduces) equals the sum without the exchange.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed


def _tower():
    from transformers import Qwen2_5_VLConfig

    from mimo_sft.model.pixels import PixelNorm
    from mimo_sft.model.qwen2_5_vl import Qwen25VisionEncoder
    from mimo_sft.model.vision_attention import SEGMENT_ATTENTION

    cfg = Qwen2_5_VLConfig(vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=48, patch_size=14, spatial_merge_size=2,
                                              temporal_patch_size=2, window_size=56,
                                              fullatt_block_indexes=[1])).vision_config
    cfg._attn_implementation = SEGMENT_ATTENTION
    torch.manual_seed(0)
    tower = Qwen25VisionEncoder(cfg).float()
    tower.pixel_norm = PixelNorm((0.48, 0.46, 0.41), (0.27, 0.26, 0.28), 1 / 255, 2)
    return tower


#: each rank's items as pixel grids (t, h, w): rank 0 a large page, a clip of 2 temporal patches (4 frame rows)
#: and a small page; rank 1 one small page -- the plan moves rank 0's work to rank 1
ITEMS = {0: [[1, 12, 16], [4, 8, 8], [1, 4, 4]], 1: [[1, 4, 8]]}


def _inputs(rank: int, kind: str):
    grid = torch.tensor(ITEMS[rank], dtype=torch.int64)
    g = torch.Generator().manual_seed(10 + rank)
    rows = int(grid.prod(1).sum())
    if kind == "uint8":  # the data path's rows: C*P*P bytes per (frame) patch
        return torch.randint(0, 256, (rows, 3 * 14 * 14), generator=g, dtype=torch.uint8), grid
    images = grid.clone()
    images[:, 0] = 1  # transformers' float patches carry images only (T frames folded into each row)
    images = images[[0, 2]] if rank == 0 else images
    return torch.randn(int(images.prod(1).sum()), 3 * 2 * 14 * 14, generator=g), images


def exchange(rank: int, world: int, kind: str) -> dict:
    import torch.distributed as dist

    from mimo_sft.train import encoder_balance as eb

    tower = _tower()
    pixels, grid = _inputs(rank, kind)
    if kind == "mixed" and rank == 1:
        pixels = pixels.to(torch.bfloat16)  # another dtype on one rank: refused on every rank
    gloo = dist.new_group(backend="gloo")
    eb.take_step_figures(), eb.take_encoded_patches()
    try:
        out = eb.balanced_forward(tower.forward, pixels, grid, group=gloo, gloo=gloo, temporal=2, merge=2)
    except RuntimeError as err:
        return {"error": str(err)}
    weight = torch.randn_like(out, generator=torch.Generator().manual_seed(rank))
    (out * weight).sum().backward()
    balanced = {n: p.grad.clone() for n, p in tower.named_parameters()}
    tower.zero_grad(set_to_none=True)
    alone = tower(pixels, grid)
    (alone * weight).sum().backward()
    gaps = []
    for n, p in tower.named_parameters():  # each tower has its encoded images' gradients: DDP sums them
        mine, want = balanced[n].clone(), p.grad.clone()
        dist.all_reduce(mine, group=gloo)
        dist.all_reduce(want, group=gloo)
        gaps.append(float((mine - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    grad_gap = max(gaps)
    figures = eb.take_step_figures()
    return {"out_gap": float((out - alone).abs().max() / alone.abs().max()), "grad_gap": grad_gap,
            "moved": figures.get("encoder_balance_moved_images", 0.0), "encoded": eb.take_encoded_patches(),
            "own": float(sum(int(t // 2 if t > 1 else 1) * h * w for t, h, w in grid.tolist()))}


@pytest.mark.parametrize("kind", ["uint8", "float"])
def test_each_rank_gets_its_own_images_encoded_elsewhere_back_with_their_gradients(kind):
    ranks = run_distributed(exchange, 2, kind)
    for rank, r in enumerate(ranks):
        assert r["moved"] > 0, r
        # another tower may run the image in another batch: the same numbers to fp32 rounding
        assert r["out_gap"] <= 1e-5 and r["grad_gap"] <= 1e-5, (rank, r)
    # each tower's encoded patches are what the plan sent it: together all of them, and the load moved
    assert sum(r["encoded"] for r in ranks) == sum(r["own"] for r in ranks)
    assert ranks[0]["encoded"] < ranks[0]["own"] and ranks[1]["encoded"] > ranks[1]["own"], ranks


def test_rows_of_different_dtypes_are_refused_on_every_rank():
    ranks = run_distributed(exchange, 2, "mixed")
    assert all("pixel rows of different widths/dtypes" in r.get("error", "") for r in ranks), ranks
