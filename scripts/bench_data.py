#!/usr/bin/env python
"""Samples/s of the data pipeline: pixel path (encoder ranks) vs metadata-only path (language ranks).

    python scripts/bench_data.py [--samples 512] [--workers 0 2] [--micro-batch-size 8] [--seq-length 256]
                                 [--model-dir DIR] [--dataset DIR] [--max-pixels N]

Builds a tiny checkpoint and a demo dataset in a temporary folder unless given. Each row times
``--batches`` micro-batches from ``build_microbatch_iterator`` after one warm-up micro-batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rate(cfg, model_dir, *, need_pixels, workers, mbs, batches, source, preprocessor):
    from mimo_sft.data.loader import build_microbatch_iterator

    it = build_microbatch_iterator(cfg, model_dir=model_dir, micro_batch_size=mbs, canonical_grid=1, dp_size=1,
                                   dp_rank=0, need_pixels=need_pixels, seed=0, num_workers=workers,
                                   source=source, preprocessor=preprocessor)
    next(it)  # warm-up: worker start, first batch
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    dt = time.perf_counter() - t
    del it
    return batches * mbs / dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--max-pixels", type=int, default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--dataset", default=None)
    a = p.parse_args(argv)

    import logging

    import datasets

    datasets.disable_progress_bars()
    logging.getLogger("mimo_sft.data").setLevel(logging.ERROR)
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.testing.demo_data import write_demo_dataset
    from mimo_sft.data.loader import build_preprocessor, dataset_stats
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    tmp = tempfile.mkdtemp(prefix="bench_data_")
    model_dir = a.model_dir or str(write_tiny_checkpoint(os.path.join(tmp, "tiny")))
    dataset = a.dataset or str(write_demo_dataset(os.path.join(tmp, "demo"), samples=a.samples, seed=0))
    cfg = DataConfig(dataset_path=dataset, seq_length=a.seq_length, max_pixels=a.max_pixels, dataloader_type="cyclic")
    source = load_sft_dataset(cfg)
    pre = build_preprocessor(cfg, model_dir)
    stats = dataset_stats(cfg, model_dir=model_dir, source=source, preprocessor=pre)
    print(f"dataset: {stats['samples']} samples, {stats['images']} images, {stats['text_only']} text-only, "
          f"{stats['multi_image']} multi-image, patches/image {stats['patches_per_image_min']}-"
          f"{stats['patches_per_image_max']} (mean {stats['patches_per_image_mean']:.0f}), "
          f"tokens mean {stats['tokens_mean']:.0f} max {stats['tokens_max']}")
    print(f"micro-batch {a.micro_batch_size}, seq_length {a.seq_length}, {a.batches} micro-batches timed, cpu count {os.cpu_count()}")
    print()
    print("| path | workers | samples/s | samples/s per worker |")
    print("|---|---:|---:|---:|")
    rates = {}
    for workers in a.workers:
        for name, need_pixels in (("pixels", True), ("metadata-only", False)):
            r = _rate(cfg, model_dir, need_pixels=need_pixels, workers=workers, mbs=a.micro_batch_size,
                      batches=a.batches, source=source, preprocessor=pre)
            rates[(name, workers)] = r
            print(f"| {name} | {workers} | {r:.0f} | {r / max(workers, 1):.0f} |", flush=True)
    for workers in a.workers:
        print(f"metadata-only / pixels at {workers} workers: "
              f"{rates[('metadata-only', workers)] / rates[('pixels', workers)]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
