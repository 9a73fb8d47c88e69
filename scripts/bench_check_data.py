#!/usr/bin/env python
"""Rows/s of ``mimo-sft check-data`` (every sample decoded once) at a given dataset size.

    python scripts/bench_check_data.py [--rows 100000] [--workers 0 2] [--image-size 56] [--seq-length 256]

Writes a JSON Lines dataset of ``--rows`` rows in a temporary folder: every row a one-turn chat; 3 of
4 rows name one image file (a few hundred distinct PNGs of ``--image-size`` pixels square, reused, so
the file cache holds them and the figure is decode + template + tokenize + positions, not disk), 1
of 4 is text-only. The tiny checkpoint's processor is used (its pixel bounds; a real checkpoint's
tokenizer is larger but encodes at a similar rate). Each row of the table is one full
``check_dataset`` pass over every row, including its worker start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_rows(folder: str, rows: int, image_size: int, distinct: int = 256) -> str:
    from PIL import Image

    os.makedirs(os.path.join(folder, "img"), exist_ok=True)
    for k in range(distinct):
        Image.new("RGB", (image_size, image_size), (k % 256, (7 * k) % 256, (13 * k) % 256)).save(
            os.path.join(folder, "img", f"{k:04d}.png"))
    path = os.path.join(folder, "rows.jsonl")
    with open(path, "w") as fh:
        for i in range(rows):
            has_image = i % 4 != 3
            content = ([{"type": "image", "image": f"img/{i % distinct:04d}.png"}] if has_image else []) + \
                      [{"type": "text", "text": f"Question {i}: what is shown here, and what is {i} plus {i % 17}?"}]
            fh.write(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": [{"type": "text", "text": f"It is {i + i % 17}."}]}]}) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--seq-length", type=int, default=256)
    a = p.parse_args(argv)

    import logging

    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.check import check_dataset
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    tmp = tempfile.mkdtemp(prefix="bench_check_data_")
    model = str(write_tiny_checkpoint(os.path.join(tmp, "tiny"), seed=0))
    t = time.perf_counter()
    data = write_rows(os.path.join(tmp, "data"), a.rows, a.image_size)
    print(f"dataset: {a.rows:,} rows ({a.image_size}x{a.image_size} PNGs, 3 of 4 rows with one image), "
          f"written in {time.perf_counter() - t:.1f} s; cpus: {os.cpu_count()}")
    cfg = DataConfig(dataset_path=data, seq_length=a.seq_length)
    print(f"{'rows':>10} {'workers':>8} {'seconds':>9} {'rows/s':>9} {'problems':>9}")
    for w in a.workers:
        t = time.perf_counter()
        report = check_dataset(cfg, model_dir=model, workers=w)
        dt = time.perf_counter() - t
        assert report["counts"]["samples"] == a.rows
        print(f"{a.rows:>10,} {w:>8} {dt:>9.1f} {a.rows / dt:>9.0f} {len(report['problems']):>9}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
