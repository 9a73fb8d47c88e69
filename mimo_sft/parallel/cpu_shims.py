"""The one module that adapts megatron-core to machines without CUDA (or without triton).

Two kinds of shims live here and nowhere else:

* ``ensure_megatron_importable()``: ``import megatron.core`` pulls in
  ``megatron.core.transformer.moe.ops.paged_stash``, which imports triton for MoE-only kernels.
  Where triton is missing we register a stand-in for that single module (never a fake top-level
  ``triton``, which breaks ``torch._dynamo``). Dense models never call those kernels.
* ``apply_cpu_shims()``: the CUDA-only call sites megatron reaches during MIMO training, bridged
  for gloo on CPU. Applied only when ``torch.cuda.is_available()`` is False, so CPU and GPU runs
  go through the same megatron code. Every shim names the megatron call site it serves.

Never edit installed megatron files; patch here.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def ensure_megatron_importable() -> None:
    """Make ``import megatron.core`` work where triton is not installed (idempotent)."""
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
