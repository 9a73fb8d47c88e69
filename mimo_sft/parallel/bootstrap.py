"""Starting a process: the one way finetune, export, check-model and the tests get their world.

Every entry point goes through here, in the same order:

0. for ``finetune`` and ``evaluate`` (:func:`start_world`): the collective recorder
   (``parallel.collectives``: the last collective each thread entered, for the hang watchdog);
1. this process's device (``runtime.use_device``: before the process group, NCCL needs it set);
2. the world group, created by ``parallel.groups`` (the only module that creates process groups):
   from torchrun's environment, or -- without torchrun, and for the 1-rank tools -- as one rank whose
   store lives in this process (``HashStore``: no port to find, nothing to rendezvous with; inside
   torchrun a TCP init would reach torchrun's agent store instead and hang);
3. ``WORLD_SIZE`` set to the size of the world just started, here and nowhere else (megatron's
   ``HyperCommGrid`` reads the variable before it asks torch.distributed; after ``finetune
   --export-hf`` destroyed the training group, torchrun's value would be stale);
4. for the 1-rank tools only (:func:`start_single_process`): the colocated 1-rank layout's groups and
   megatron's process-local state (``runtime.init_megatron``). A training run builds its layout's
   groups and megatron's state in ``train.setup``.

megatron is made importable once, when ``mimo_sft.parallel`` is imported (its ``__init__``).

The module imports nothing heavy at the top, so ``finetune`` can check how it was launched (and
refuse a multi-rank layout without torchrun) before torch is loaded.
"""

from __future__ import annotations

import os

from mimo_sft.errors import UserError

_SINGLE_STATE = None


def launched_by_torchrun() -> bool:
    """torchrun (torchelastic) gives every process RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_rank_world() -> tuple[int, int]:
    """This process's (rank, world size) as its launcher sets them, before any group exists:
    torchrun's variables, or ``(0, 1)`` without torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def require_launcher(world_size: int) -> None:
    """A layout of more than one rank needs torchrun; one rank also runs without it."""
    if world_size != 1 and not launched_by_torchrun():
        raise UserError(f"this layout needs {world_size} ranks; start it with "
                        f"mimo-sft finetune --nproc-per-node {world_size} ... (or torchrun --nproc-per-node "
                        f"{world_size} -m mimo_sft finetune ...)")


def start_world(*, timeout_s: float = 600.0, prefer: str = "auto") -> tuple[int, int]:
    """Choose this process's device, then start the world group; returns ``(rank, world size)``.

    Under torchrun: torchrun's world (NCCL on a GPU, gloo on the CPU). Without torchrun: one rank,
    same backend, store in this process. ``timeout_s`` applies to every group of the run (megatron's
    included, see ``runtime.set_default_group_timeout``). Idempotent: a running world is kept.
    """
    import torch.distributed as dist

    from mimo_sft.parallel import collectives, runtime

    if not dist.is_initialized():
        collectives.install()  # before the CPU shims bind all_gather (the hang watchdog names collectives)
        _choose_device(prefer)
        timeout = runtime.set_default_group_timeout(timeout_s)
        _start(runtime.backend(), in_process=not launched_by_torchrun(), timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def start_single_process(prefer: str = "auto"):
    """The 1-rank world of export, check-model and tests: returns the colocated 1-rank layout
    ``language=dp=1`` + ``images=dp=1``'s ``ParallelState`` (built once per process).

    The device is chosen unless it already is (a finetune process exporting at the end keeps its
    own; ``prefer="cpu"`` keeps a GPU machine's GPUs out of it); the group is a gloo group in this
    process, also inside torchrun (``finetune --export-hf`` starts it after the training group is
    destroyed); megatron's process-local state is (re)initialised on every call.
    """
    global _SINGLE_STATE
    import torch.distributed as dist

    from mimo_sft.parallel import runtime

    _choose_device(prefer)
    if not dist.is_initialized():
        _start("gloo", in_process=True, timeout=None)
    if dist.get_world_size() != 1:
        raise RuntimeError("start_single_process() needs a 1-rank process group")
    runtime.init_megatron(0, tp_rank=0)
    if _SINGLE_STATE is None:
        from mimo_sft.parallel.components import parse_component
        from mimo_sft.parallel.groups import build_parallel_state
        from mimo_sft.parallel.layout import Layout

        layout = Layout.from_specs([parse_component("language=dp=1"), parse_component("images=dp=1")])
        _SINGLE_STATE = build_parallel_state(layout)
    return _SINGLE_STATE


def _choose_device(prefer: str) -> None:
    from mimo_sft.parallel import runtime

    if not runtime.device_chosen():
        runtime.use_device(runtime.select_device(prefer))


def _start(backend: str, *, in_process: bool, timeout) -> None:
    """Create the world group (in ``parallel.groups``) and publish its size as ``WORLD_SIZE``."""
    import torch.distributed as dist

    from mimo_sft.parallel.groups import start_world_group

    start_world_group(backend, in_process=in_process, timeout=timeout)
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
