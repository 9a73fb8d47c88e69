"""Rank layout (pure arithmetic), starting processes, and the one place that creates process groups.

``layout`` and ``components`` import neither torch.distributed nor megatron, so ``validate`` stays
fast and they are unit-tested without processes. ``bootstrap`` starts this process's world (from
torchrun's environment, or as one rank without torchrun) and sets up megatron; ``groups`` builds
HyperCommGrids and every process group; ``runtime`` is the device switch; ``cpu_shims`` is the only
module that patches megatron for CPU runs.

Importing this package makes ``import megatron.core`` work once for the whole process
(:func:`ensure_megatron_importable`); every module that imports megatron is imported after it.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def ensure_megatron_importable() -> None:
    """Make ``import megatron.core`` work where triton is not installed (idempotent, torch-free).

    ``import megatron.core`` pulls in ``megatron.core.transformer.moe.ops.paged_stash``, which
    imports triton for MoE-only kernels. Where triton is missing a stand-in is registered for that
    single module (never a fake top-level ``triton``, which breaks ``torch._dynamo``). Dense models
    never call those kernels. Costs a ``find_spec`` (well under a millisecond) and imports nothing
    heavy, so ``validate`` stays fast.
    """
    if _PAGED_STASH_OPS in sys.modules:
        return
    if importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_PAGED_STASH_OPS)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def _needs_triton(*_a, **_k):  # only MoE paged stashing reaches these kernels
        raise RuntimeError("MoE paged-stash kernels need triton; install triton to use them")

    stub.paged_stash_copy_kernel = _needs_triton
    stub.paged_stash_pop_kernel = _needs_triton
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH_OPS] = stub


ensure_megatron_importable()
