"""Shared fixtures-by-function for the reorder tests: synthetic samples and gloo worlds.

Samples are a pure function of their ``sample_id`` so any process can regenerate the original of
a sample it received and compare it byte for byte. Workers run under ``torch.multiprocessing``
spawn with a real gloo ``init_process_group`` on localhost.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import preloaded
from dist_utils import free_port
from mimo_sft.data.reorder import serialize

IMAGE_TOKEN_ID = 151655
MERGE = 2
SEQ = 40
PIX_DIM = 12
PAD_ID = 0


def _image_grids(sample_id: int, text_only: bool) -> list[tuple[int, int, int]]:
    """0, 1 or 2 images; sizes bimodal (small documents vs. big scans) so balancing matters."""
    if text_only:
        return []
    g = torch.Generator().manual_seed(1000 + sample_id)
    n = int(torch.randint(0, 3, (1,), generator=g))
    grids = []
    for _ in range(n):
        big = bool(torch.rand(1, generator=g) < 0.35)
        h, w = ((4, 6) if big else (2, 2)) if torch.rand(1, generator=g) < 0.5 else ((6, 4) if big else (2, 4))
        grids.append((1, h, w))
    return grids


def make_sample(sample_id: int, *, with_pixels: bool, text_only: bool = False) -> dict[str, torch.Tensor]:
    """One sample as a batch of 1, with every contract field plus extra dtypes (f16, bf16, i32, u8)."""
    grids = _image_grids(sample_id, text_only)
    g = torch.Generator().manual_seed(sample_id)
    n_text = int(torch.randint(3, 10, (1,), generator=g))
    ids: list[int] = []
    mm: list[int] = []
    for grid in grids:
        n_tok = grid[0] * grid[1] * grid[2] // (MERGE * MERGE)
        ids += [IMAGE_TOKEN_ID] * n_tok
        mm += [1] * n_tok
    text = torch.randint(10, 1000, (n_text,), generator=g).tolist()
    ids += text
    mm += [0] * n_text
    real = len(ids)
    assert real <= SEQ
    ids += [PAD_ID] * (SEQ - real)
    mm += [0] * (SEQ - real)
    input_ids = torch.tensor([ids], dtype=torch.int64)
    out = {
        "input_ids": input_ids,
        "labels": torch.cat([input_ids[:, 1:], torch.full((1, 1), PAD_ID)], dim=1),
        "loss_mask": (torch.rand(1, SEQ, generator=g) > 0.5).float(),
        "attention_mask": torch.arange(SEQ).unsqueeze(0) < real,
        "position_ids": torch.randint(0, 500, (3, 1, SEQ), generator=g),
        "mm_token_type_ids": torch.tensor([mm], dtype=torch.int64),
        "image_counts": torch.tensor([len(grids)], dtype=torch.int64),
        "sample_ids": torch.tensor([sample_id], dtype=torch.int64),
        "extra_f16": torch.randn(1, 3, generator=g).half(),
        "extra_bf16": torch.randn(1, 5, generator=g).bfloat16(),
        "extra_i32": torch.randint(-9, 9, (1, 2), generator=g, dtype=torch.int32),
        "extra_u8": torch.randint(0, 255, (1, 7), generator=g, dtype=torch.uint8),
    }
    if with_pixels:
        n_patch = sum(t * h * w for t, h, w in grids)
        out["pixel_values"] = torch.randn(n_patch, PIX_DIM, generator=g) + sample_id
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return out


def make_batch(sample_ids, *, with_pixels: bool, text_only: bool = False) -> dict[str, torch.Tensor]:
    return serialize.merge_samples([make_sample(int(s), with_pixels=with_pixels, text_only=text_only) for s in sample_ids])


def assert_batch_intact(batch: dict[str, torch.Tensor], *, with_pixels: bool, text_only_ids=()) -> None:
    """Every sample of ``batch`` equals its regenerated original, field by field, byte for byte."""
    records = serialize.split_samples(batch)
    for rec in records:
        sid = int(rec["sample_ids"][0])
        ref = make_sample(sid, with_pixels=with_pixels, text_only=sid in text_only_ids)
        assert set(rec) == set(ref), (sid, sorted(rec), sorted(ref))
        for key in ref:
            a, b = rec[key], ref[key]
            assert a.dtype == b.dtype and a.shape == b.shape, (sid, key, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), (sid, key)


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; any worker's exception fails the test.
    The workers are forked from the preloaded parent of ``tests/preloaded.py`` where it can stand in
    (their tracebacks go to this test's stderr), else spawned."""
    zygote = preloaded.usable(dict(os.environ))
    if zygote is None:
        mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
        return
    code, codes = preloaded.run_call(zygote, world, _entry, (world, free_port(), fn, args), timeout=600)
    assert code == 0, f"a worker failed (exit codes {codes}, None: timed out); its traceback is on stderr"


def encoder_slice_pixels(batch: dict[str, torch.Tensor], encoder: slice) -> dict[str, torch.Tensor]:
    """``batch`` as the data layer hands a colocated rank its read shard: every sample's text fields,
    the pixels of its encoder slice only (``build_microbatch_iterator(pixel_slice=...)``)."""
    recs = serialize.split_samples(batch)
    out = dict(batch)
    out.update(serialize.merge_samples([{k: r[k] for k in ("pixel_values", "image_grid_thw")} for r in recs[encoder]]))
    return out
