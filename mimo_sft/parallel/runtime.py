"""The device switch and megatron's process-local set-up: one path for CPU and GPU, every entry point.

Why this module exists: megatron-core expects state that only its own ``initialize_model_parallel``
creates (the global memory buffer that local attention borrows scratch space from, and the
model-parallel RNG tracker seeded with this rank's tensor and expert ranks). mimo-sft builds its
process groups from HyperCommGrids and never calls that function, so :func:`init_megatron` creates
exactly that state. ``finetune``, ``export``, ``check-model`` and the tests all go through it, on CPU
and GPU alike, so a CPU test runs every line a GPU run executes.

The device is chosen here and nowhere else (:func:`use_device`); the rest of the package asks
:func:`device`. On the CPU the shims in :mod:`mimo_sft.parallel.cpu_shims` replace megatron's
CUDA-only calls; on a GPU nothing is patched.
"""

from __future__ import annotations

import datetime
import os
import random
import time
from typing import Any, Optional

import numpy as np
import torch

_DEVICE: Optional[torch.device] = None


# ---- the device switch ----------------------------------------------------------------------------
def select_device(prefer: str = "auto") -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is usable and not declined (``prefer="cpu"``), else the CPU."""
    if prefer not in ("auto", "cpu"):
        raise ValueError(f"prefer must be 'auto' or 'cpu', got {prefer!r}")
    if prefer == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % torch.cuda.device_count())


def use_device(dev: torch.device) -> torch.device:
    """Make ``dev`` this process's device (before the process group starts: NCCL needs it set).

    A CPU device applies the CPU shims, even on a machine with GPUs (export builds on the CPU so it
    never competes with training memory); a CUDA device patches nothing.
    """
    global _DEVICE
    if _DEVICE is not None and _DEVICE != dev:
        raise RuntimeError(f"device already chosen ({_DEVICE}); cannot switch this process to {dev}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:  # the CPU, or the device audit's stand-in (testing.device_audit): megatron's CUDA calls go there
        from mimo_sft.parallel.cpu_shims import apply_cpu_shims

        apply_cpu_shims(dev)
    _DEVICE = dev
    return dev


def device_chosen() -> bool:
    return _DEVICE is not None


def device() -> torch.device:
    """This process's device; :func:`use_device` (or ``parallel.bootstrap``) must have run."""
    assert _DEVICE is not None, "no device chosen yet: call runtime.use_device() or bootstrap.start_world() first"
    return _DEVICE


def on_gpu() -> bool:
    return device().type == "cuda"


def backend() -> str:
    """The process-group backend for model traffic on this device: NCCL on a GPU, gloo on the CPU, and gloo for
    both the CPU and the device audit's stand-in device (``testing.device_audit``), whose tensors gloo moves by
    their host bytes."""
    if on_gpu():
        return "nccl"
    return "gloo" if device().type == "cpu" else f"cpu:gloo,{device().type}:gloo"


def set_default_group_timeout(seconds: float) -> datetime.timedelta:
    """Every process group created without an explicit timeout gets ``seconds``.

    megatron's bridge and colocated communicators create their groups without a timeout, so torch
    would give them its backend default (NCCL: 10 minutes) whatever ``--dist-timeout`` says. torch
    reads these two module constants for that default; groups mimo-sft creates also pass the
    timeout explicitly.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    return timeout


# ---- megatron's process-local state ----------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Python, numpy and torch (every device) from one seed."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def init_megatron(seed: int, *, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Create what megatron's layers need before a model is built (idempotent; resets the RNG tracker).

    * the global memory buffer (local ``DotProductAttention`` takes its scratch tensor from it);
    * the model-parallel RNG tracker (dropout and GPU initialisation fork it), seeded the way
      megatron seeds it but with ranks taken from our layout: megatron would otherwise ask its global
      tensor-parallel group, which mimo-sft never creates.
    """
    from megatron.core import parallel_state, tensor_parallel

    device()  # the device must be chosen first: on the CPU the shims make the tracker work
    seed_everything(seed)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank,
                                                    force_reset_rng=True)


# ---- moving data and measuring ---------------------------------------------------------------------
def to_device(batch: dict) -> dict:
    """A micro-batch's tensors on this process's device (the CPU keeps them as they are).

    Host tensors are pinned first so the copy really is asynchronous: ``non_blocking`` from pageable
    memory is a synchronous copy.
    """
    dev = device()
    if dev.type == "cpu":
        return batch
    return {k: (host_to(v, dev) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v)
            for k, v in batch.items()}


def host_to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev``, copied asynchronously: on CUDA from pinned memory, since a copy from
    pageable memory waits for the device's queued work (the sync it should avoid)."""
    dev = torch.device(dev)
    if t.device == dev:
        return t
    if dev.type == "cuda":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


class StepClock:
    """How long a step took. On a GPU, from CUDA events around it: without device syncs in the step, the host's
    clock measures only how long queuing the kernels took. The events are read when the device has passed the
    end event (``seconds``, called after the log interval's loss read has waited for it). Elsewhere (the CPU,
    the device audit's stand-in) the host's clock is the step's time."""

    def __init__(self):
        self._host = time.perf_counter()
        self._events = None
        self.host_s: Optional[float] = None
        if on_gpu():
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> float:
        """End of the step: the host's seconds (what time limits and the hang watchdog go by)."""
        self.host_s = time.perf_counter() - self._host
        if self._events is not None:
            self._events[1].record()
        return self.host_s

    def seconds(self) -> float:
        """The step's time: the device's between the events on a GPU (waits for the end event), else the host's."""
        assert self.host_s is not None, "StepClock.seconds() before stop()"
        if self._events is None:
            return self.host_s
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0


def reset_peak_memory() -> None:
    """Start a new peak-memory window (per step on GPU; the CPU's peak RSS cannot be reset)."""
    if on_gpu():
        torch.cuda.reset_peak_memory_stats(device())


def peak_memory_bytes() -> int:
    """Peak device memory since the last reset on GPU; peak resident set size of this process on CPU."""
    if on_gpu():
        return int(torch.cuda.max_memory_allocated(device()))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def release_cached_memory() -> None:
    """Give the device allocator's cached blocks back (after a model is dropped); nothing on the CPU."""
    if on_gpu():
        torch.cuda.empty_cache()


def device_name() -> str:
    return torch.cuda.get_device_name(device()) if on_gpu() else "cpu"


# ---- RNG state for checkpoints ----------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG stream a step can draw from: Python, numpy, torch CPU, the device, megatron's tracker."""
    from megatron.core import tensor_parallel

    kind, key, pos, has_gauss, gauss = np.random.get_state()  # the key as a list: a rank file holds no numpy object
    state = {"python": random.getstate(), "numpy": (kind, key.tolist(), pos, has_gauss, gauss),
             "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if on_gpu():
        state["cuda"] = torch.cuda.get_rng_state(device())
    return state


def saved_device_type(rank_state: dict[str, Any]) -> str:
    """The device type a rank file was written on (its ``device``; files from before it was recorded: "cuda" when
    they hold a CUDA generator state, else "cpu")."""
    return rank_state.get("device") or ("cuda" if "cuda" in rank_state.get("rng", {}) else "cpu")


def restore_rng(rank_state: dict[str, Any], *, seed: int, step: int, ranks: dict[str, int]) -> Optional[str]:
    """A rank file's RNG streams, on this process's device. Saved on the same kind of device: every stream as it
    was. Saved on another kind (a CPU checkpoint resumed on a GPU, or the reverse): the device's streams --
    megatron's tracker (dropout, LoRA dropout) and the CUDA generator -- cannot be carried over (their states
    are another generator's: "RNG state is wrong size"), so they are seeded from the run's seed and the step;
    Python, numpy and torch's host generator carry over. Returns the line that says so, or None."""
    from megatron.core import tensor_parallel

    saved, now = saved_device_type(rank_state), device().type
    if saved == now:
        set_rng_state(rank_state["rng"])
        return None
    host = {k: v for k, v in rank_state["rng"].items() if k not in ("tracker", "cuda")}
    tensor_parallel.model_parallel_cuda_manual_seed(seed + step, force_reset_rng=True, **ranks)
    set_rng_state(host)  # after: megatron's seeding also seeds the generator it stands the tracker on
    return (f"checkpoint written on {saved}, resumed on {now}: the device's random streams (dropout) restart from "
            f"the seed and step {step}; the host's streams, weights, optimizer state and data position are restored")


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if on_gpu() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device())
