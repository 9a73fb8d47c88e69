#!/usr/bin/env python
"""Bytes a streamed parquet source reads per rank, with real-size document pages (issue 32).

    python scripts/bench_streamed_reads.py [--rows 512] [--row-groups 8 32 128] [--dp 2 4 8]
                                           [--micro-batch-size 32] [--page 1700x2200]

A streamed parquet row is read with its row group (``data.shards``), and a process keeps its last
``CACHED_GROUPS`` groups. Each DP rank reads its canonical share of every global micro-batch
(``micro_batch_size / dp`` consecutive rows of a source read in order), so a row group of ``R`` rows
is read by every rank whose share falls in it: about ``min(dp, max(1, R * dp / micro_batch_size))``
times in all. This writes ``--rows`` rows, one real-size page each (a rendered page of ``--page``
pixels, JPEG quality 85: ~0.3-0.5 MB, the size of a scanned document page), as parquet shards with
``--row-groups`` rows a group, then reads, for each DP size, every rank's shares through the real
``StreamedSource`` (a fresh process cache per rank, as in its own DataLoader worker) and counts the
Arrow bytes of every row group it reads. ``whole micro-batch`` reads every row of each micro-batch
on every rank: index mode's owned samples may lie anywhere in the micro-batch (its upper bound;
without a cost file its cost pass reads the rank's share first). The table gives the bytes all
ranks read over the bytes of the data, the measured and the formula's read factor.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _page(w: int, h: int, rng: random.Random) -> bytes:
    """A document-like page: white, lines of dark "text" strokes, a grey figure; JPEG quality 85."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), (250, 250, 247))
    draw = ImageDraw.Draw(img)
    for y in range(80, h - 80, 28):
        x = 90
        while x < w - 120:
            n = rng.randint(20, 90)
            draw.line([(x, y), (x + n, y)], fill=(rng.randint(0, 60),) * 3, width=rng.randint(8, 12))
            x += n + rng.randint(10, 18)
    draw.rectangle([w // 5, h // 2, w // 2, h // 2 + h // 6], fill=(150, 150, 160))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _write(folder: str, rows: int, group_rows: int, pages: list[bytes]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(folder, f"groups_{group_rows}")
    os.makedirs(path, exist_ok=True)
    msg = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Read the page."}]},
           {"role": "assistant", "content": [{"type": "text", "text": "It says hello."}]}]
    half = rows // 2
    for k, (lo, hi) in enumerate(((0, half), (half, rows))):  # two shards
        table = pa.table({"messages": [msg] * (hi - lo),
                          "images": [[{"bytes": pages[i % len(pages)], "path": None}] for i in range(lo, hi)]})
        pq.write_table(table, os.path.join(path, f"train-{k:05d}.parquet"), row_group_size=group_rows)
    return path


def _bytes_read(path: str, dp: int, mbs: int, whole: bool) -> int:
    """Arrow bytes of the row groups every rank reads over all micro-batches of one epoch."""
    import pyarrow.parquet as pq

    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.sampler import CanonicalSampler
    from mimo_sft.data.sources import load_sft_dataset

    total = 0
    for rank in range(dp):
        source = load_sft_dataset(DataConfig(dataset_path=path, streaming=True), check_files=False)
        read = []
        real = pq.ParquetFile.read_row_group

        def counting(self, *a, **kw):
            table = real(self, *a, **kw)
            read.append(table.nbytes)
            return table

        pq.ParquetFile.read_row_group = counting
        try:
            sampler = CanonicalSampler(len(source), micro_batch_size=mbs, canonical_grid=dp, dp_size=dp, dp_rank=rank,
                                       whole_micro_batch=whole)
            for k in range(len(source) // mbs):
                for i in sampler.rank_indices(k):
                    source[i]
        finally:
            pq.ParquetFile.read_row_group = real
        total += sum(read)
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--row-groups", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--page", default="1700x2200")
    args = p.parse_args(argv)
    w, h = (int(x) for x in args.page.split("x"))
    rng = random.Random(0)
    pages = [_page(w, h, rng) for _ in range(16)]  # 16 distinct pages, reused: the bytes are what count
    mbs = args.micro_batch_size
    print(f"{args.rows} rows, one {w}x{h} JPEG page each ({sum(map(len, pages)) / len(pages) / 2**20:.2f} MB mean), "
          f"global micro-batch {mbs}, rows read in order\n")
    print("| rows a row group | DP | ranks read | read by all ranks (MB) | data (MB) | read factor | formula |\n"
          "|---:|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for group_rows in args.row_groups:
            path = _write(tmp, args.rows, group_rows, pages)
            once = _bytes_read(path, 1, mbs, whole=False)
            for dp in args.dp:
                for whole in (False, True):
                    got = _bytes_read(path, dp, mbs, whole=whole)
                    formula = dp if whole else min(dp, max(1.0, group_rows * dp / mbs))
                    print(f"| {group_rows} | {dp} | {'whole micro-batch' if whole else 'own share'} "
                          f"| {got / 2**20:.0f} | {once / 2**20:.0f} | {got / once:.2f} | {formula:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
