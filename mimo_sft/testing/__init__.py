"""Fixtures for tests, the demo and the benchmarks: a tiny Qwen2.5-VL checkpoint and a synthetic dataset.

Not part of the data layer: training never imports this package. It builds folders in the same
formats a user brings (an HF checkpoint folder, a parquet SFT dataset), so the code under test reads
them exactly as it reads real ones::

    from mimo_sft.testing import write_tiny_checkpoint, write_demo_dataset

    model_dir = write_tiny_checkpoint("tiny-qwen2.5-vl", seed=0)   # scripts/make_tiny_qwen_vl.py
    data_dir = write_demo_dataset("demo-data", samples=400, seed=0)  # scripts/make_demo_data.py

Exports are lazy, like ``mimo_sft.data``'s: importing the package pulls in no transformers/datasets.
"""

from __future__ import annotations

from mimo_sft.lazy_exports import lazy_getattr

_EXPORTS = {
    "write_tiny_checkpoint": "mimo_sft.testing.tiny_checkpoint",
    "write_preset_checkpoint": "mimo_sft.testing.tiny_checkpoint",
    "PRESETS": "mimo_sft.testing.tiny_checkpoint",
    "write_demo_dataset": "mimo_sft.testing.demo_data",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
