"""Shared fixtures for the data tests (imported by test modules; the lead owns conftest.py).

The tiny checkpoint and demo dataset are built once per process and cached in a temporary folder,
because every data test needs them and building takes a few seconds.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest

_ROOT = Path(tempfile.mkdtemp(prefix="mimo_sft_data_tests_"))
atexit.register(shutil.rmtree, _ROOT, True)


@functools.lru_cache(maxsize=None)
def tiny_checkpoint_dir() -> Path:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(_ROOT / "tiny_qwen_vl", seed=0)


@functools.lru_cache(maxsize=None)
def demo_dataset_dir(samples: int = 48, seed: int = 0) -> Path:
    from mimo_sft.testing.demo_data import write_demo_dataset

    return write_demo_dataset(_ROOT / f"demo_{samples}_{seed}", samples=samples, seed=seed)


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    return tiny_checkpoint_dir()


@pytest.fixture(scope="session")
def demo_data() -> Path:
    return demo_dataset_dir()
