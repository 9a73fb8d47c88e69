"""Lazy package exports (PEP 562): a flat public API whose modules are imported on first use.

Why: ``import mimo_sft.data`` and ``import mimo_sft.testing`` must stay cheap (no transformers or
datasets until a name is used) and still offer ``from mimo_sft.data import load_processor``; both
packages build their module ``__getattr__`` from a ``name -> module`` table here. Pure stdlib.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: attribute ``name`` of module ``exports[name]``, imported
    when first asked for; any other name is an AttributeError naming ``package``, as Python's own."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
