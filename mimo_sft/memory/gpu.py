"""The budget check 23 holds a forecast to (``--gpu-memory-gb``, else this machine's GPU, else 80 GB), and
the device whose kernels it counts (``forecast_device``).

Why lazy: ``validate`` stays fast on a laptop, so torch is imported only where a CUDA driver is
present (``/proc/driver/nvidia`` or ``/dev/nvidia0``) or already imported (``finetune``).
"""

from __future__ import annotations

import os
import sys

#: the budget where no GPU can be asked: an 80 GB H100 / A100
DEFAULT_GPU_GB = 80.0
GB = 1024 ** 3  # an "80 GB" A100 or H100 has 80 GiB (81,920 / 81,559 MiB in nvidia-smi)


def local_gpu_bytes() -> int | None:
    """Total memory of CUDA device 0, or None without a usable CUDA GPU."""
    if "torch" not in sys.modules and not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU here": the default budget applies
        return None
    return None


def gpu_budget_bytes(gpu_memory_gb: float | None) -> tuple[int, str]:
    """``(bytes, where the figure came from)`` for check 23 and the forecast table."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GB), f"--gpu-memory-gb {gpu_memory_gb:g}"
    local = local_gpu_bytes()
    if local is not None:
        return local, f"this machine's GPU ({local / GB:.1f} GiB)"
    return int(DEFAULT_GPU_GB * GB), f"default {DEFAULT_GPU_GB:g} GiB (no GPU here; set --gpu-memory-gb)"


def forecast_device(*, for_run: bool, planning: bool) -> str:
    """The device whose kernels the forecast counts (``memory.activations.DEVICES``): ``cuda``, what clusters
    run, for ``validate`` and ``plan`` (both forecast a run elsewhere), and for a run on a machine with a
    CUDA GPU; ``cpu`` for a ``finetune`` / ``evaluate`` (``for_run``) on a machine without one, which then
    trains on the CPU (``parallel.runtime.select_device``)."""
    if for_run and not planning and local_gpu_bytes() is None:
        return "cpu"
    return "cuda"
