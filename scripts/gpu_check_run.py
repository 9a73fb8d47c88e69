#!/usr/bin/env python
"""One GPU-check training run: ``mimo-sft finetune`` in this process, and what only this process can see.

    python scripts/gpu_check_run.py RESULT.json -- FINETUNE_FLAGS...

Runs exactly ``mimo-sft finetune FINETUNE_FLAGS`` (one rank, no launcher) and writes RESULT.json with what
the run's metrics.jsonl does not hold:

* ``forecast``: the memory forecast ``mimo-sft validate`` makes for these flags (each module's peak, their
  sum on this one colocated rank, the workload it assumed), computed before the run;
* ``peak_reserved_bytes``: the most memory the CUDA caching allocator held at any time of the run (sampled
  every 20 ms, and its own peak counter, which the trainer resets each step), beside which the metrics'
  per-step peak allocated is read; None on the CPU;
* ``gdn_kernels``: whose Gated DeltaNet kernels megatron's layers called: ``fla`` (fla's function, or a
  wrapper of it) or ``torch`` (mimo-sft's torch kernels), None for a model without linear attention -- read
  from megatron's module after the run, so it is what ran, whatever decided it;
* ``device``, ``device_memory_bytes``, ``rc`` (the command's exit status).

Exits with the command's status.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def forecast(flags: list[str]) -> dict:
    """validate's memory forecast for ``flags`` (no process group, no model: config and formulas only)."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    memory = check_config(load_config(list(flags))).memory
    if memory is None:
        return {"bytes": None}
    modules = {name: m["peak_bytes"] for name, m in memory["modules"].items()}
    return {"bytes": sum(modules.values()), "modules": modules, "workload": memory["workload"]}


class ReservedSampler(threading.Thread):
    """The highest ``torch.cuda.memory_reserved()`` seen, polled from a daemon thread (a host-side read of the
    allocator's counters: no device sync)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()

    def run(self):
        import torch

        while not self.stop.wait(0.02):
            if torch.cuda.is_initialized():
                self.peak = max(self.peak, torch.cuda.memory_reserved())


def kernel_owner(fn) -> str:
    """``fla`` when ``fn`` is fla's function or wraps one (``__wrapped__``, or a function it closes over),
    ``torch`` when it is mimo-sft's torch kernel, else its qualified name."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if (getattr(f, "__module__", None) or "").split(".")[0] == "fla":
            return "fla"
        todo.append(getattr(f, "__wrapped__", None))
        todo.extend(cell.cell_contents for cell in (getattr(f, "__closure__", None) or ())
                    if callable(getattr(cell, "cell_contents", None)))
    module = getattr(fn, "__module__", None) or ""
    return "torch" if module == "mimo_sft.model.gdn_kernels" else f"{module}.{getattr(fn, '__qualname__', fn)}"


def gdn_kernels() -> str | None:
    """Whose gated delta rule megatron's GDN layers called (``kernel_owner``); None without a GDN layer."""
    common = sys.modules.get("megatron.core.ssm.gated_delta_net.common")
    rule = getattr(common, "chunk_gated_delta_rule", None)
    return None if rule is None else kernel_owner(rule)


def finetune(flags: list[str]) -> int:
    """``mimo-sft finetune FLAGS`` in this process; its exit status."""
    from mimo_sft.cli import main

    sys.argv = ["mimo-sft", "finetune", *flags]
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the run's own traceback, as the command would print it
        traceback.print_exc()
        return 1
    return 0


def device_facts(sampler: ReservedSampler) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "device_memory_bytes": None, "peak_reserved_bytes": None}
    sampler.peak = max(sampler.peak, torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved())
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "device_memory_bytes": props.total_memory, "peak_reserved_bytes": sampler.peak}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out, flags = argv[0], argv[2:]
    result: dict = {"flags": flags}
    try:
        result["forecast"] = forecast(flags)
    except Exception as e:  # a refused config: finetune below says why, in its own words
        result["forecast"] = {"bytes": None, "error": f"{type(e).__name__}: {e}"}
    sampler = ReservedSampler()
    sampler.start()
    t0 = time.perf_counter()
    rc = finetune(flags)
    sampler.stop.set()
    result.update(rc=rc, seconds=time.perf_counter() - t0, gdn_kernels=gdn_kernels(), **device_facts(sampler))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
