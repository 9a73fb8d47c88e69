"""Metrics for people and machines, written by the rank that owns the language loss.

* people: a rich progress line per ``log_interval`` steps (step, loss, lr, step time, ETA);
* machines: ``metrics.jsonl`` (one JSON object per step) and TensorBoard event files.

Other ranks construct a disabled logger so call sites need no rank checks.
"""

from __future__ import annotations

import json
import os
import time

from rich.console import Console

REQUIRED_KEYS = ("step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "samples_per_s",
                 "vision_load_max_over_mean_before", "vision_load_max_over_mean_after",
                 "reorder_exchange_s", "peak_memory_bytes", "model_tflops_per_gpu", "mfu")


def step_model_flops(local_flops: float, pstate) -> float:
    """The step's model FLOPs: the sum of every rank's counted share (collective, every rank)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([local_flops], dtype=torch.float64)
    dist.all_reduce(t, group=pstate.world_gloo)
    return float(t.item())


def throughput(step_flops: float, step_time_s: float, world_size: int, peak_tflops: float | None) -> dict:
    """``model_tflops_per_gpu`` and ``mfu`` (a fraction; None without a known peak, e.g. on CPU)."""
    from mimo_sft.train.flops import achieved_tflops_per_gpu, mfu

    achieved = achieved_tflops_per_gpu(step_flops, step_time_s, world_size)
    return {"model_tflops_per_gpu": achieved, "mfu": mfu(achieved, peak_tflops)}


def peak_memory_by_module(pstate) -> dict[str, int]:
    """This step's peak memory, the largest over all ranks and per module (collective, every rank).

    ``peak_memory_bytes`` is the largest of any rank (GPU: device memory since the step began; CPU:
    the process's peak resident set size, which cannot be reset); ``peak_memory_bytes_<module>`` the
    largest over that module's ranks, so encoder GPUs are reported as well as language ones.
    """
    import torch
    import torch.distributed as dist

    from mimo_sft.parallel import runtime

    names = list(pstate.modules)
    mine = runtime.peak_memory_bytes()
    t = torch.tensor([mine if pstate.modules[n].member else 0 for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pstate.world_gloo)
    per = {f"peak_memory_bytes_{n}": int(v) for n, v in zip(names, t.tolist())}
    return {"peak_memory_bytes": max(per.values()), **per}


class MetricsLogger:
    def __init__(self, output_dir: str, *, enabled: bool, total_steps: int, log_interval: int = 1,
                 tensorboard: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.log_interval = max(1, log_interval)
        self.console = console or Console(highlight=False, soft_wrap=True)
        self._tb = None
        self._fh = None
        self._t0 = time.perf_counter()
        self._steps_timed = 0
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._fh = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:  # tensorboard is in requirements; keep training if it is absent
                self.console.print("[yellow]tensorboard not installed: no event files[/yellow]")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        missing = [k for k in REQUIRED_KEYS if k not in record]
        assert not missing, f"metrics record lacks {missing}"
        self._fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
        self._steps_timed += 1
        step = record["step"]
        if step % self.log_interval == 0 or step == self.total_steps:
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / self._steps_timed * max(0, self.total_steps - step)
            before = record.get("vision_load_max_over_mean_before")
            after = record.get("vision_load_max_over_mean_after")
            load = ""
            if before is not None:
                load = f" | vision load max/mean {before:.3f}" + (f" -> {after:.3f}" if after is not None else "")
            mfu = f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else ""
            self.console.print(
                f"step {step:>5}/{self.total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad norm {record['grad_norm']:.3f} | {record['step_time_s']:.2f} s/step | "
                f"{record['tokens_per_s']:.0f} tok/s{mfu}{load} | ETA {eta:.0f} s"
            )

    def close(self) -> None:
        if self._fh:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
