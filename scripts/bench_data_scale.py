#!/usr/bin/env python
"""Data at cluster scale (issue 22): start-up file check, bytes per image, exchange vs index bytes.

    python scripts/bench_data_scale.py startup [--rows 100000 1000000] [--files 20000] [--ranks 1 4]
    python scripts/bench_data_scale.py bytes   [--dp 2 4 8] [--micro-batch-size 32] [--pages 64]

``startup``: a parquet of ``--rows`` rows whose ``images`` column names files by path (``--files``
distinct small PNGs on local disk, reused cyclically: 1M distinct files would need 4 GB of inodes on
this shared machine; a ``stat`` of a cached dentry costs the same). For each rank count R it starts
R processes at once that each do what a rank does before step 0: open the dataset, and either
check every path (``before``: every rank, the old way) or only rank 0 checks and the others wait
(``once``: this issue's way; the verdict cache is off); ``--old COMMIT`` adds the predecessor's
check (``combine_chunks`` of the whole column, on every rank). It prints wall time until the last
rank is ready and the largest peak RSS of one rank.

``bytes``: bytes per image for real page sizes (Qwen2.5-VL's processor: patch 14, merge 2, max
12.8 Mpx) as fp32 patches (before) and uint8 patches (now), measured on real images through the
data path, and the bytes the reorder exchange would move per micro-batch at DP 2/4/8 for a mix of
1-4 Mpx pages (``plan.simulate.exchange_bytes``, checked against real records by
tests/test_reorder_index.py) against 0 for ``--reorder-mode index``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_rows(folder: str, rows: int, files: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    img = os.path.join(folder, "img")
    os.makedirs(img, exist_ok=True)
    for i in range(files):
        Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(os.path.join(img, f"{i:06d}.png"))
    msg = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    path = os.path.join(folder, f"rows_{rows}.parquet")
    writer = None
    chunk = 100_000
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        table = pa.table({"messages": [msg] * n, "images": [[f"img/{(start + i) % files:06d}.png"] for i in range(n)]})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


def _old_sources(commit: str):
    """The predecessor's ``data/sources.py`` (whole-column ``combine_chunks`` check), as a module."""
    import importlib.util
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "-C", root, "show", f"{commit}:mimo_sft/data/sources.py"], check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_sources.py")
    with open(path, "w") as fh:
        fh.write(text)
    spec = importlib.util.spec_from_file_location("old_sources", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rank(rank: int, path: str, mode: str, ready, verdict) -> None:
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.file_check import cached_check
    from mimo_sft.data.sources import load_sft_dataset

    if mode.startswith("old:"):  # every rank runs the predecessor's load-and-check
        _old_sources(mode[4:]).load_sft_dataset(DataConfig(dataset_path=path))
        ready.put((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        return
    source = load_sft_dataset(DataConfig(dataset_path=path), check_files=False)
    if mode == "before" or rank == 0:
        assert cached_check(source, None) is None
        if rank == 0:
            verdict.set()
    else:
        verdict.wait()  # training: a broadcast on the start-up group (parallel.groups.STARTUP_WAIT)
    ready.put((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def startup(args) -> None:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"| rows | ranks | check | to ready (s) | peak RSS per rank (MB) |\n|---:|---:|---|---:|---:|")
        for rows in args.rows:
            path = _write_rows(tmp, rows, args.files)
            for ranks in args.ranks:
                modes = ("before", "once") if ranks > 1 else ("once",)
                for mode in ((f"old:{args.old}",) if args.old else ()) + modes:
                    q, ev = ctx.Queue(), ctx.Event()
                    t0 = time.perf_counter()
                    procs = [ctx.Process(target=_rank, args=(r, path, mode, q, ev)) for r in range(ranks)]
                    for p in procs:
                        p.start()
                    out = [q.get() for _ in procs]
                    for p in procs:
                        p.join()
                    wall = max(t for t, _ in out) - t0
                    rss = max(m for _, m in out) / 2**20
                    label = {"before": "every rank, streamed", "once": "rank 0, others wait"}.get(
                        mode, f"every rank, whole column ({args.old})")
                    print(f"| {rows:,} | {ranks} | {label} | {wall:.1f} | {rss:.0f} |", flush=True)


def _page(w: int, h: int, seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def bytes_table(args) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.plan.simulate import MicroBatchLoad, exchange_bytes
    from mimo_sft.data.reorder import window_plan

    ip = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136,
                                  max_pixels=12845056)
    pre = SamplePreprocessor.__new__(SamplePreprocessor)  # the image path only (no tokenizer)
    pre.image_processor, pre.patch_size, pre.merge_size = ip, 14, 2
    print("| page (px) | patches | fp32 patches (MB, before) | uint8 patches (MB, now) | bytes per pixel |")
    print("|---|---:|---:|---:|---|")
    for w, h in ((1000, 1000), (1414, 1414), (2000, 1500), (2000, 2000)):
        img = _page(w, h, 0)
        u8, grid = pre._uint8_patches(img)
        fp32 = ip(images=[img], return_tensors="np")["pixel_values"]
        print(f"| {w}x{h} | {u8.shape[0]:,} | {fp32.nbytes / 1e6:.1f} | {u8.nbytes / 1e6:.2f} | "
              f"{fp32.nbytes / (u8.shape[0] * 196):.0f} -> {u8.nbytes / (u8.shape[0] * 196):.0f} |")
    rng = random.Random(0)
    mbs = args.micro_batch_size
    print(f"\nexchange bytes per micro-batch of {mbs} (1-4 Mpx pages, 25 % text-only; seq 4096), "
          f"mean of {args.pages} micro-batches\n")
    print("| DP (both modules) | samples moved | exchange, fp32 (MB) | exchange, uint8 (MB) | index (MB) |")
    print("|---:|---:|---:|---:|---:|")
    for dp in args.dp:
        loads = []
        for _ in range(args.pages):
            patches = [0.0 if rng.random() < 0.25 else float(rng.randint(1_000_000, 4_000_000) // 196 // 4 * 4)
                       for _ in range(mbs)]
            loads.append(MicroBatchLoad(list(range(mbs)), patches, [0.0] * mbs, [int(p > 0) for p in patches]))
        orders = [window_plan.window_orders([mb.patches], dp)[0] for mb in loads]
        dps = {"images": dp, "language": dp}
        moved = sum(sum(1 for k, i in enumerate(o) if k // (mbs // dp) != i // (mbs // dp)) for o in orders)
        fp32 = exchange_bytes(loads, orders, dp_sizes=dps, seq_length=4096, patch_bytes=4 * 1176)
        u8 = exchange_bytes(loads, orders, dp_sizes=dps, seq_length=4096, patch_bytes=588)
        print(f"| {dp} | {100 * moved / (len(orders) * mbs):.0f} % | {sum(fp32) / len(fp32) / 1e6:.0f} | "
              f"{sum(u8) / len(u8) / 1e6:.0f} | 0 |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("startup")
    s.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    s.add_argument("--files", type=int, default=20_000)
    s.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    s.add_argument("--old", default=None, help="also time this commit's data/sources.py (the check before issue 22)")
    b = sub.add_parser("bytes")
    b.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    b.add_argument("--micro-batch-size", type=int, default=32)
    b.add_argument("--pages", type=int, default=64)
    args = p.parse_args(argv)
    startup(args) if args.what == "startup" else bytes_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
