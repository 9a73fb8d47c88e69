#!/usr/bin/env python
"""Data at cluster scale (issues 22, 33): start-up (open, file check, validation check), bytes per
image, exchange vs index bytes, index mode's data-path CPU per rank.

    python scripts/bench_data_scale.py startup [--rows 1000000 10000000] [--files 20000] [--ranks 4]
                                               [--valid-rows 2000] [--old 0e2b3fe]
    python scripts/bench_data_scale.py streaming [--rows 1000000] [--shards 16] [--ranks 4] [--valid-rows 2000]
    python scripts/bench_data_scale.py bytes   [--dp 2 4 8] [--micro-batch-size 32] [--pages 64]
    python scripts/bench_data_scale.py index   [--micro-batch-sizes 16 32 64] [--per-rank 8] [--batches 4]

``startup`` (issues 22, 33): a parquet of ``--rows`` rows whose ``images`` column names files by
path (``--files`` distinct 8x8 PNGs on local disk, reused cyclically: 10M distinct files would need
40 GB of inodes on this shared machine; only headers are ever read). For each rank count R it
starts R gloo processes that each do what a rank does before step 0, timed from a common barrier
after the imports: open the dataset (a fresh ``datasets`` cache per row, so the parquet -> Arrow
conversion is always paid), check the image files (the verdict cache is off), and tokenise the first
``--valid-rows`` rows as a validation set evaluated whole (the tiny checkpoint's tokenizer and
processor). ``before``: the ``--old`` commit's ``data/sources.py``, ``file_check.py`` and
``validation.py`` run as its ``train.feed`` did (every rank opens at once, rank 0 stats every path
on one thread, every rank tokenises the whole validation set); ``now``: ``train.feed.checked_source``
and ``train.evaluate.checked_tokens``. It prints the slowest rank's phase ends and the largest
peak RSS of one rank, and at ready the largest private (anonymous) and file-backed resident memory
of one rank (the memory-mapped Arrow file is file-backed: one copy in the node's page cache, counted
in every rank's RSS).

``bytes``: bytes per image for real page sizes (Qwen2.5-VL's processor: patch 14, merge 2, max
12.8 Mpx) as fp32 patches (before) and uint8 patches (now), measured on real images through the
data path, and the bytes the reorder exchange would move per micro-batch at DP 2/4/8 for a mix of
1-4 Mpx pages (``plan.simulate.exchange_bytes``, checked against real records by
tests/test_reorder_index.py) against 0 for ``--reorder-mode index``.

``index``: the CPU one rank spends on its data path per micro-batch in ``--reorder-mode index``, at
global micro-batch 16/32/64 with ``--per-rank`` samples per rank (DP = micro-batch / per-rank, one
gloo process per rank), before (every rank runs the text path of the whole global micro-batch: the
whole-read path, ``group=None``) and now (the text path of its own shard for the costs, one
all-gather, then its owned samples). Language path (text only) and encoder path (text + pixels).
Everything runs in the rank's process (``--num-workers 0``), so its CPU time (all threads) is the
whole data path; each rank also checks that both paths gave the same micro-batch. Data: the real
Qwen2.5-VL tokenizer and processor (``write_preset_checkpoint``, patch 14; ``--max-pixels`` 6.4 Mpx, ``--seq-length`` 16384) on
document-like rows: 1-5.6 Mpx pages with long questions and answers, 15 % multi-image, 20 % long
text-only rows.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_rows(folder: str, rows: int, files: int, shards: int = 0) -> str:
    """``rows`` rows naming ``files`` image files; one parquet file, or (``shards``) a folder of that many."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    img = os.path.join(folder, "img")
    os.makedirs(img, exist_ok=True)
    for i in range(files):
        Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(os.path.join(img, f"{i:06d}.png"))
    msg = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    path = os.path.join(folder, f"rows_{rows}" + ("" if shards else ".parquet"))
    writer, chunk = None, 100_000
    per = -(-rows // shards) if shards else rows
    if shards:
        os.makedirs(path, exist_ok=True)
    start = 0
    while start < rows:
        if shards and start % per == 0 and writer is not None:
            writer.close()
            writer = None
        n = min(chunk, rows - start, per - start % per)
        table = pa.table({"messages": [msg] * n, "images": [[f"../img/{(start + i) % files:06d}.png" if shards else
                                                               f"img/{(start + i) % files:06d}.png"] for i in range(n)]})
        target = os.path.join(path, f"train-{start // per:05d}.parquet") if shards else path
        writer = writer or pq.ParquetWriter(target, table.schema, write_statistics=False)
        writer.write_table(table, row_group_size=1024 if shards else None)
        start += n
    writer.close()
    return path


def _old_module(commit: str, relpath: str):
    """``relpath`` (a module of mimo_sft) as it was at ``commit``, imported under a private name."""
    import importlib.util
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "-C", root, "show", f"{commit}:{relpath}"], check=True,
                          capture_output=True, text=True).stdout
    name = "old_" + os.path.basename(relpath)[:-3]
    path = os.path.join(tempfile.mkdtemp(), name + ".py")
    with open(path, "w") as fh:
        fh.write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rss() -> dict:
    """This process's private (anonymous) and file-backed resident bytes: the memory-mapped Arrow
    file counts in every rank's RSS but is one copy in the page cache, shared by the node."""
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}


def _startup_rank(rank: int, world: int, port: int, path: str, model: str, mode: str, n_valid: int, out) -> None:
    """One rank's start-up before step 0, ``before`` (the commit's code) or ``now``; phase end times."""
    import torch
    import torch.distributed as dist

    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.train.evaluate import checked_tokens
    from mimo_sft.train.feed import checked_source

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # the start-up group (parallel.groups: startup_gloo)
    data = DataConfig(dataset_path=path, seq_length=256, streaming=mode == "streamed")
    pre = build_preprocessor(data, model) if n_valid else None
    if mode not in ("now", "streamed"):
        old_sources = _old_module(mode, "mimo_sft/data/sources.py")
        old_check = _old_module(mode, "mimo_sft/data/file_check.py")
        old_valid = _old_module(mode, "mimo_sft/data/validation.py")
    dist.barrier(group)
    t0 = time.time()
    if mode in ("now", "streamed"):  # train.feed.checked_source: one conversion per node, the threaded check on rank 0
        source = checked_source(SimpleNamespace(data=data, logging=SimpleNamespace(output_dir=None)),
                                SimpleNamespace(rank=rank, startup_gloo=group))
        t_open = t_check = time.time()  # one call: the followers open while rank 0 checks
    else:  # the commit's train.feed.checked_source: every rank opens at once, rank 0 checks serially
        source = old_sources.load_sft_dataset(data, check_files=False)
        t_open = time.time()
        verdict = [old_check.cached_check(source, None) if rank == 0 else None]
        dist.broadcast_object_list(verdict, src=0, group=group)
        assert verdict[0] is None, verdict
        t_check = time.time()
    if n_valid:  # the first n_valid rows as the validation set, evaluated whole (--eval-iters all)
        if mode in ("now", "streamed"):
            checked_tokens(source, pre, n_valid, flag="--valid-split", group=group)
        else:
            old_valid.check_validation_set(source, pre, n_valid, flag="--valid-split")
    t_valid = time.time()
    mem = _rss()
    dist.barrier(group)
    out.put((rank, (t_open - t0, t_check - t0, t_valid - t0,
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, mem["RssAnon"], mem["RssFile"])))
    dist.destroy_process_group()


def startup(args) -> None:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from dist_utils import free_port

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")  # the spawned ranks inherit it
    ctx = mp.get_context("spawn")
    modes = ([args.old] if args.old and args.old != "none" else []) + ["now"]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(os.path.join(tmp, "model"), seed=0)) if args.valid_rows else ""
        print(f"{args.valid_rows:,} validation rows tokenised (--eval-iters all); times are the slowest rank's, "
              f"from the ranks' common start\n")
        print("| rows | ranks | code | opened (s) | files checked (s) | validation checked: ready (s) "
              "| peak RSS per rank (MB) | at ready: private (MB) | at ready: mapped files (MB) |\n"
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        for rows in args.rows:
            t = time.perf_counter()
            path = _write_rows(tmp, rows, args.files)
            print(f"<!-- {rows:,} rows written in {time.perf_counter() - t:.0f} s -->", flush=True)
            for ranks in args.ranks:
                for mode in modes:
                    # a fresh datasets cache: every row pays the parquet -> Arrow conversion
                    os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, f"cache_{rows}_{ranks}_{mode}")
                    q, port = ctx.Queue(), free_port()
                    procs = [ctx.Process(target=_startup_rank,
                                         args=(r, ranks, port, path, model, mode, args.valid_rows, q))
                             for r in range(ranks)]
                    for p in procs:
                        p.start()
                    res = _results(q, procs)
                    opened, checked, ready = (max(r[k] for r in res) for k in range(3))
                    peak, private, mapped = (max(r[k] for r in res) / 2**20 for k in (3, 4, 5))
                    label = "now" if mode == "now" else f"before ({mode})"
                    opened = "with the check" if mode == "now" else f"{opened:.1f}"  # one call, overlapped
                    print(f"| {rows:,} | {ranks} | {label} | {opened} | {checked:.1f} | {ready:.1f} | {peak:.0f} "
                          f"| {private:.0f} | {mapped:.0f} |", flush=True)
                    shutil.rmtree(os.environ.pop("HF_DATASETS_CACHE"), ignore_errors=True)
            os.remove(path)


def streaming(args) -> None:
    """A source of ``--rows`` rows in ``--shards`` parquet shards, opened before step 0 by ``--ranks``
    ranks: loaded through datasets (one Arrow copy per node) vs streamed (read in place)."""
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from dist_utils import free_port

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(os.path.join(tmp, "model"), seed=0)) if args.valid_rows else ""
        print(f"{args.valid_rows:,} validation rows tokenised; image files checked; times are the slowest rank's\n")
        print("| rows | shards | ranks | source | ready (s) | peak RSS per rank (MB) | at ready: private (MB) "
              "| at ready: mapped files (MB) | written to the cache (MB) |\n|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        for rows in args.rows:
            path = _write_rows(tmp, rows, args.files, shards=args.shards)
            for ranks in args.ranks:
                for mode in ("now", "streamed"):
                    cache = os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, f"cache_{rows}_{ranks}_{mode}")
                    q, port = ctx.Queue(), free_port()
                    procs = [ctx.Process(target=_startup_rank, args=(r, ranks, port, path, model, mode,
                                                                     args.valid_rows, q)) for r in range(ranks)]
                    for p in procs:
                        p.start()
                    res = _results(q, procs)
                    ready = max(r[2] for r in res)
                    peak, private, mapped = (max(r[k] for r in res) / 2**20 for k in (3, 4, 5))
                    copied = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs) \
                        if os.path.isdir(cache) else 0
                    label = "loaded (datasets)" if mode == "now" else "streamed (--streaming)"
                    print(f"| {rows:,} | {args.shards} | {ranks} | {label} | {ready:.1f} | {peak:.0f} | {private:.0f} "
                          f"| {mapped:.0f} | {copied / 2**20:.0f} |", flush=True)
                    shutil.rmtree(os.environ.pop("HF_DATASETS_CACHE"), ignore_errors=True)
            shutil.rmtree(path)


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


_WORDS = ("invoice total amount page section table figure report customer date item price quantity tax "
          "summary note account balance period revenue cost margin value detail line column row header "
          "address order number reference payment due status region market growth share policy").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) + ("." if rng.random() < 0.08 else "") for _ in range(words))


def _index_rows(folder: str, rows: int, seed: int = 0) -> str:
    """Document-like rows naming page files on disk (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mimo_sft.testing.demo_data import image_png

    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "img"), exist_ok=True)
    pages = []
    for i in range(32):
        big = i < 24
        w, h = (rng.randint(800, 2000), rng.randint(1200, 2800)) if big else (rng.randint(500, 1000), rng.randint(500, 1000))
        path = os.path.join(folder, "img", f"{i:03d}.png")
        with open(path, "wb") as fh:
            fh.write(image_png(rng, w, h, rng.choice(["red", "white", "blue", "yellow"]), rng.randint(0, 99)))
        pages.append(path)
    msgs, images = [], []
    for _ in range(rows):
        r = rng.random()
        n = 0 if r < 0.2 else rng.randint(2, 3) if r < 0.35 else 1
        pool = pages[24:] if n > 1 else pages[:24]
        content = [{"type": "image", "text": None} for _ in range(n)]
        content.append({"type": "text", "text": _text(rng, rng.randint(200, 2500 if n == 0 else 800))})
        msgs.append([{"role": "user", "content": content},
                     {"role": "assistant", "content": [{"type": "text", "text": _text(rng, rng.randint(50, 1500))}]}])
        images.append([rng.choice(pool) for _ in range(n)])
    path = os.path.join(folder, "rows.parquet")
    pq.write_table(pa.table({"messages": msgs, "images": images}), path)
    return path


def _index_rank(rank: int, world: int, port: int, model: str, data: str, args, out) -> None:
    """One rank: each path's CPU per micro-batch (after one warm-up), checked equal batch for batch."""
    import torch
    import torch.distributed as dist

    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.loader import build_microbatch_iterator, build_preprocessor, model_token_info
    from mimo_sft.data.reorder import make_cost_fn, make_patch_count_fn
    from mimo_sft.data.sources import load_sft_dataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    cfg = DataConfig(dataset_path=data, seq_length=16384, max_pixels=6422528, dataloader_type="cyclic")
    source, pre = load_sft_dataset(cfg), build_preprocessor(cfg, model)
    info = model_token_info(model)
    ids = dict(image_token_id=info["image_token_id"], merge_size=info["spatial_merge_size"])
    index = dict(n_groups=world, cost_fn=make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=0.1, **ids),
                 load_fn=make_patch_count_fn(**ids), stats_dp_sizes={"vision": world})
    result = {}
    for pixels in (False, True):
        seen = {}
        for path, g in (("before", None), ("now", group)):
            it = build_microbatch_iterator(cfg, model_dir=model, micro_batch_size=world * args.per_rank,
                                           canonical_grid=world, dp_size=world, dp_rank=rank, need_pixels=pixels,
                                           seed=0, num_workers=0, source=source, preprocessor=pre,
                                           index_reorder={**index, "group": g})
            batches = [next(it)]
            dist.barrier()
            t0 = time.process_time()
            batches += [next(it) for _ in range(args.batches)]
            result[pixels, path] = (time.process_time() - t0) / args.batches
            seen[path] = batches
            it.shutdown()
        for a, b in zip(seen["before"], seen["now"]):
            assert all(torch.equal(a[k], b[k]) for k in a), "the two paths gave different micro-batches"
        if not pixels:
            result["tokens"] = float(torch.cat([b["attention_mask"].sum(1) for b in seen["now"]]).float().mean())
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _results(q, procs) -> list:
    """Every rank's result; a rank that died ends the benchmark instead of leaving it waiting."""
    import queue

    res = []
    while len(res) < len(procs):
        try:
            res.append(q.get(timeout=5)[1])
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank failed (exit codes {dead}); see its traceback above")
    for p in procs:
        p.join()
    return res


def index_table(args) -> None:
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from dist_utils import free_port

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")  # the spawned ranks inherit it
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_preset_checkpoint(os.path.join(tmp, "model"), "qwen2.5-vl-3b"))
        data = _index_rows(tmp, args.rows)
        print(f"CPU per micro-batch per rank (ms, mean over ranks, {args.batches} micro-batches after one warm-up), "
              f"{args.per_rank} samples per rank\n")
        print("| global micro-batch | DP | tokens/sample | language path: before | now | encoder path: before | now |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for mbs in args.micro_batch_sizes:
            world = mbs // args.per_rank
            q, port = ctx.Queue(), free_port()
            procs = [ctx.Process(target=_index_rank, args=(r, world, port, model, data, args, q)) for r in range(world)]
            for p in procs:
                p.start()
            res = _results(q, procs)

            def ms(key):
                return 1e3 * sum(r[key] for r in res) / len(res)

            print(f"| {mbs} | {world} | {res[0]['tokens']:.0f} | {ms((False, 'before')):.0f} | {ms((False, 'now')):.0f} "
                  f"| {ms((True, 'before')):.0f} | {ms((True, 'now')):.0f} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("startup")
    s.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    s.add_argument("--files", type=int, default=20_000)
    s.add_argument("--ranks", type=int, nargs="+", default=[4])
    s.add_argument("--valid-rows", type=int, default=2000, help="validation rows tokenised (0: none)")
    s.add_argument("--old", default="0e2b3fe", help="the 'before' rows: this commit's data/sources.py, "
                   "file_check.py and validation.py, run as its train.feed did ('none': skip them)")
    st = sub.add_parser("streaming")
    st.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    st.add_argument("--shards", type=int, default=16)
    st.add_argument("--files", type=int, default=20_000)
    st.add_argument("--ranks", type=int, nargs="+", default=[4])
    st.add_argument("--valid-rows", type=int, default=2000)
    b = sub.add_parser("bytes")
    b.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    b.add_argument("--micro-batch-size", type=int, default=32)
    b.add_argument("--pages", type=int, default=64)
    x = sub.add_parser("index")
    x.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    x.add_argument("--per-rank", type=int, default=8)
    x.add_argument("--batches", type=int, default=4)
    x.add_argument("--rows", type=int, default=256)
    args = p.parse_args(argv)
    {"startup": startup, "streaming": streaming, "bytes": bytes_table, "index": index_table}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
