"""Shared test setup: offline Hugging Face, one thread per process, no progress bars, repo root on sys.path.

The progress-bar defaults are what ``mimo_sft.cli.main`` and ``quiet_libraries`` set before a run's
heavy imports: with them here, this process, the preloaded parent of ``tests/preloaded.py`` and a
real torchrun rank all import datasets and huggingface_hub with the same environment.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mimo_sft  # noqa: E402,F401  (its import hook must precede any test module's torchvision import)
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep ``--dist loadgroup`` grouping (``make test``'s shared runs: one worker builds a run that several tests
    read). pytest-xdist 3.8 tags a grouped test by setting ``item._nodeid`` to ``<nodeid>@<group>``; pytest 9.2
    derives ``nodeid`` from ``item._id`` instead, so the tag was lost and every grouped test was scheduled alone
    (a shared run was made once per worker that met it). Copy the tag where pytest reads it."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # a pytest that still reads ``_nodeid``
        return
    for item in items:
        tagged = item.__dict__.get("_nodeid")
        if isinstance(tagged, str) and tagged != item.nodeid and "_id" in dir(item):
            item._id = coerce_node_id(tagged)
