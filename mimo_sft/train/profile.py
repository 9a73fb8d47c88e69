"""``--profile-steps A:B``: a torch.profiler trace of steps A..B on the ranks of ``--profile-ranks``.

Each profiled rank writes one chrome-trace JSON file, ``PROFILE_DIR/rank{R}.{time}.pt.trace.json``,
through torch's ``tensorboard_trace_handler`` (the name and place TensorBoard's profiler plugin reads:
``tensorboard --logdir PROFILE_DIR``); the same file opens in Perfetto (ui.perfetto.dev) or
``chrome://tracing``. The profiler starts before step A's first operation and stops after step B's
optimizer step, so the trace holds exactly those steps, each inside a ``step N`` range.

The step's phases are named ranges (``torch.profiler.record_function``) on the training thread:

=====================  ===========================================================================
range                  where it is opened
=====================  ===========================================================================
``data wait``          ``train.feed.Feed.__next__``: the schedule waiting for its next micro-batch
``reorder wait``       inside it, ``data.reorder.buffer``: waiting for the reorder exchange
                       (``--reorder-mode exchange``; the index mode plans in the data loader: data wait)
``encoder forward``    the vision module's forward (module hooks below)
``encoder backward``   from the gradient of its output; ends where the next phase starts (its input,
                       pixels, has no gradient to mark the end)
``bridge``             ``train.bridge.PaddedBridge`` (colocated fan-in/out) and megatron's
                       multi-module pipeline communicator (non-colocated sends and receives)
``language forward``   the language model's forward
``language backward``  from the gradient of its output to the gradient of its input embeddings
                       (a later pipeline stage, whose input is set by megatron, ends it where the next
                       phase starts)
``gradient finalize``  ``train.step.StepRunner``: the DP reductions' wait and the token scale
``optimizer``          ``train.trainer.Trainer.train_step``: megatron's optimizer step
=====================  ===========================================================================

The module phases come from hooks the trainer installs for the whole run (:class:`ModulePhases`): every
phase, module phases included, is entered in ``mimo_sft.progress.PROGRESS`` (the hang watchdog's progress and
the straggler report's seconds per phase); the module phases open a profiler range only while torch's profiler
records. A few phases per micro-batch, microseconds each (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch.autograd.profiler import record_function

from mimo_sft.config.checks.overlap import parse_profile_ranks, parse_profile_steps, profile_folder
from mimo_sft.progress import PROGRESS


class _OpenRange:
    """At most one module phase open at a time on this thread: a backward range has no closing event
    of its own where its module's input carries no gradient, so opening the next phase closes it.
    The phase is always entered in ``PROGRESS`` (the watchdog's progress, the straggler report's seconds); a
    profiler range is opened only while torch's profiler records."""

    def __init__(self):
        self._current = None
        self._name: Optional[str] = None

    def open(self, name: str) -> None:
        self.close()
        PROGRESS.enter(name)
        self._name = name
        if torch.autograd._profiler_enabled():
            self._current = record_function(name)
            self._current.__enter__()

    def close(self) -> None:
        if self._name is not None:
            PROGRESS.leave(self._name)
            self._name = None
        if self._current is not None:
            current, self._current = self._current, None
            current.__exit__(None, None, None)


#: the module phase open on the training thread (hooks of :class:`ModulePhases`)
_OPEN = _OpenRange()


class phase:
    """A named range for a phase that has its own end (``with phase("optimizer"): ...``); it first
    closes a module backward range still open, which ended where this phase begins. Entering and leaving it
    are the progress the hang watchdog watches (``train.watchdog.PROGRESS``)."""

    def __init__(self, name: str):
        self.name = name
        self._range = None

    def __enter__(self):
        _OPEN.close()
        PROGRESS.enter(self.name)
        self._range = record_function(self.name)
        return self._range.__enter__()

    def __exit__(self, *exc):
        PROGRESS.leave(self.name)
        return self._range.__exit__(*exc)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class ModulePhases:
    """Forward and backward ranges of named modules, from forward hooks and tensor gradient hooks
    (no module or autograd graph is changed; removed by :meth:`remove`)."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.range = _OPEN
        self._handles = []
        for label, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(label), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(label)))

    def _pre_hook(self, label: str):
        def hook(_module, args, kwargs):
            self.range.open(f"{label} forward")
            if torch.is_grad_enabled():  # the gradient of the input closes this module's backward range
                for t in [*_tensors(args), *_tensors(kwargs)]:
                    if t.requires_grad:
                        t.register_hook(self._close_backward)
            return None

        return hook

    def _post_hook(self, label: str):
        def hook(_module, _args, output):
            self.range.close()
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._open_backward(label))
            return None

        return hook

    def _open_backward(self, label: str):
        def hook(_grad):
            self.range.open(f"{label} backward")

        return hook

    def _close_backward(self, _grad) -> None:
        self.range.close()

    def remove(self) -> None:
        self.range.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class StepProfiler:
    """Starts torch.profiler before step A and writes the trace after step B on the chosen ranks.

    ``steps`` are 1-based step numbers of the whole run; a run resumed past A profiles what is left
    of A..B. ``modules``: label ("encoder", "language") -> the module whose phases are ranges, hooked while the
    profile records; the trainer passes none, its :class:`ModulePhases` hooks stay for the whole run.
    """

    def __init__(self, *, steps: Optional[tuple[int, int]], ranks: Optional[frozenset[int]], rank: int,
                 folder: str, modules: dict[str, torch.nn.Module]):
        self.steps = steps
        self.enabled = steps is not None and (ranks is None or rank in ranks)
        self.rank = rank
        self.folder = folder
        self.modules = modules
        self._profiler = None
        self._phases: Optional[ModulePhases] = None
        self._step_range = None
        self.trace_path: Optional[str] = None

    @classmethod
    def from_config(cls, cfg, *, rank: int, world_size: int, modules: dict) -> "StepProfiler":
        lg = cfg.logging
        return cls(steps=parse_profile_steps(lg.profile_steps, cfg.train.train_iters),
                   ranks=parse_profile_ranks(lg.profile_ranks, world_size), rank=rank,
                   folder=profile_folder(cfg), modules=modules)

    def say_if_passed(self, start: int) -> None:
        """A run resumed at step ``start`` (its next step is ``start + 1``) past the whole profile range
        records nothing: say so once, with what to pass instead, rather than write no trace in silence."""
        if self.enabled and start >= self.steps[1]:
            print(f"mimo-sft: rank {self.rank}: --profile-steps {self.steps[0]}:{self.steps[1]} is before this "
                  f"run's first step ({start + 1}): nothing is profiled; pass steps from {start + 1} on", flush=True)

    def _profiled(self, step: int) -> bool:
        return self.enabled and self.steps[0] <= step <= self.steps[1]

    def begin_step(self, step: int) -> None:
        """Before step ``step`` (1-based) runs: start recording at the first profiled step."""
        if not self._profiled(step):
            return
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            # the trainer's hooks are installed for the whole run (modules={}); standalone use brings its own
            self._phases = ModulePhases(self.modules) if self.modules else None
        self._step_range = record_function(f"step {step}")
        self._step_range.__enter__()

    def end_step(self, step: int) -> None:
        """After step ``step``'s optimizer step: close its range; after the last one, write the trace."""
        if self._profiler is None or self._step_range is None:
            return
        _OPEN.close()
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        if step >= self.steps[1]:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace (also when the run stops before step B)."""
        if self._profiler is None:
            return
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._phases is not None:
            self._phases.remove()
        _OPEN.close()
        self._profiler.stop()
        os.makedirs(self.folder, exist_ok=True)
        before = set(os.listdir(self.folder))
        torch.profiler.tensorboard_trace_handler(self.folder, worker_name=f"rank{self.rank}")(self._profiler)
        written = sorted(set(os.listdir(self.folder)) - before)
        self.trace_path = os.path.join(self.folder, written[0]) if written else None
        self._profiler = None
        if self.trace_path:
            print(f"mimo-sft: rank {self.rank}: profile of steps {self.steps[0]}-{self.steps[1]} in "
                  f"{self.trace_path}", flush=True)
