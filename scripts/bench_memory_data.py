#!/usr/bin/env python
"""The memory forecast from the data against what autograd keeps for the data's heaviest micro-batch, at real width.

    python scripts/bench_memory_data.py [--preset qwen2.5-vl-3b] [--rows 160] [--seq-length 4096]
        [--micro-batch-size 2] [--max-pixels 1003520] [--device cuda] [--no-in-batch-packing]
        [--dataset-path FILE] [--out DIR]

Writes document-VQA-like rows (``testing.demo_data.write_document_rows``: 1-2 page images of 0.3-0.8 Mpx of
text-like stripes, a question, an answer of 20-400 words: the GPU benchmark's data, ``docs/benchmarks.md``) and
the preset's config.json, processor and real Qwen tokenizer (no weights), runs ``check-data --write-costs`` on
them, and prints for one colocated GPU (language and images dp 1): check 23's forecast from the data's per-row
counts and the worst case beside it (GiB per GPU), then per module the forecast's activation term for the largest
micro-batch the rows can form against the bytes autograd saves for that micro-batch (``testing.worst_batch``: each
layer kind measured once on the CPU at the preset's real width, torch's flash SDPA; ``--device cuda``: torch's
RMSNorm takes its CUDA path, ``testing.saved_bytes``) and their ratio. Not a GPU measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-vl-3b")
    p.add_argument("--rows", type=int, default=160)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--max-pixels", type=int, default=1003520)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="whose RMSNorm kernels are counted")
    p.add_argument("--no-in-batch-packing", dest="packing", action="store_false")
    p.add_argument("--dataset-path", default=None, help="rows to use instead of writing --rows of them")
    p.add_argument("--out", default=None, help="folder for the model, data and cost files (default: a temporary one)")
    return p.parse_args()


def _config(a, model: str, data: str, costs: str, size: int | None = None):
    from mimo_sft.config.loader import load_config

    size = size or a.micro_batch_size
    return load_config(["--hf-model", model, "--dataset-path", data, "--cost-dir", costs, "--allow-random-init",
                        "--dtype", "bf16", "--seq-length", str(a.seq_length), "--micro-batch-size",
                        str(size), "--global-batch-size", str(size),
                        "--max-pixels", str(a.max_pixels), "--component", "language=dp=1", "--component",
                        "images=dp=1", "--gpu-memory-gb", "139",
                        "--in-batch-packing" if a.packing else "--no-in-batch-packing"])


def main() -> None:
    a = _args()
    import torch

    from mimo_sft.data.check import check_dataset
    from mimo_sft.memory.forecast import GIB, forecast_memory
    from mimo_sft.testing import worst_batch as wb
    from mimo_sft.testing.demo_data import write_document_rows
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint
    from mimo_sft.validate import check_config, data_row_counts

    out = a.out or tempfile.mkdtemp(prefix="bench_memory_data_")
    model = os.path.join(out, a.preset)
    if not os.path.exists(os.path.join(model, "config.json")):
        write_preset_checkpoint(model, a.preset)
    data = a.dataset_path or os.path.join(out, f"docs_{a.rows}.parquet")
    if not os.path.exists(data):
        write_document_rows(data, a.rows)
    cfg = _config(a, model, data, os.path.join(out, "costs"))
    check_dataset(cfg.data, model_dir=model, workers=min(4, os.cpu_count() or 1), write_costs=True)
    counts, why = data_row_counts(cfg)
    assert counts is not None, why
    print(f"{a.preset}, {counts.rows} rows, --seq-length {a.seq_length}, colocated on one GPU (language and images "
          f"dp 1), {'packed' if a.packing else 'padded rows'}, bf16: check 23's peak per GPU (CUDA's kernels)")
    print("| --micro-batch-size | this data's largest micro-batch (in force) | worst case |")
    print("|---:|---:|---:|")
    for size in sorted({1, 2, 4, 8, a.micro_batch_size}):
        one = _config(a, model, data, os.path.join(out, "costs"), size)
        report = check_config(one, row_counts=counts).memory
        print(f"| {size} | {sum(report['gpu_peaks'].values()) / GIB:.1f} GiB | "
              f"{sum(report['worst_case']['gpu_peaks'].values()) / GIB:.1f} GiB |")
    result = check_config(cfg, row_counts=counts)
    forecast = forecast_memory(cfg, result.layout, result.hf_config, counts=counts, device=a.device)
    batch = wb.worst_batch(counts, language_rows=a.micro_batch_size, vision_rows=a.micro_batch_size)
    t0 = time.perf_counter()
    measured = {"language": wb.language_saved(model, batch, dtype=torch.bfloat16, device=a.device, packed=a.packing,
                                              seq_length=a.seq_length),
                "images": wb.vision_saved(model, batch, dtype=torch.bfloat16)}
    print(f"\n--micro-batch-size {a.micro_batch_size}, the activation term ({a.device}'s kernels) against the bytes "
          f"autograd saves for the data's heaviest micro-batch, at real width on the CPU:")
    print("| module | the micro-batch | forecast activations (bytes) | measured saved (bytes) | forecast / measured |")
    print("|---|---|---:|---:|---:|")
    rows = f"{len(batch.lengths)} rows of {' + '.join(f'{n:,}' for n in batch.lengths)} real tokens"
    shapes = {"language": rows + ("" if a.packing else f", padded to {a.seq_length:,}"),
              "images": f"{len(batch.patch_rows)} rows, {len(batch.grids)} images, "
                        f"{sum(t * h * w for t, h, w in batch.grids):,} patches"}
    for module, got in measured.items():
        fc = forecast.modules[module].terms["activations"]
        print(f"| {module} | {shapes[module]} | {fc:,} | {got:,} | {fc / got:.3f} |")
    print(f"(measured in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
