"""The vision tower, built on the device it trains on: nothing initialised by the host, nothing copied over whole.

Why: megatron makes its own parameters on the device, but the vision tower is transformers' module, which
MimoModel builds as a plain ``nn.Module``: in host memory, initialised there by one CPU thread (Qwen2.5-VL-3B's
tower: 16.8 s in bf16 on this machine, docs/benchmarks.md) and only then copied to the GPU whole -- much of the
first H200 run's 135 s start-up.

MimoModel builds a spec by calling its ``module`` with the spec's params; :func:`built_on` is that ``module`` for
the tower, and calling it runs :func:`build_tower`:

* weights from a checkpoint: the tower is built with its parameters on the ``meta`` device (no memory, no
  initialiser run) and its buffers in host memory, computed by the tower's own code exactly as a plain build
  computes them (:func:`_skeleton`). ``to_empty`` then gives every parameter uninitialised memory on the device,
  which the checkpoint copy fills (``model.builder``: ``copy_into`` asserts every weight is copied), and the
  buffers -- the rotary ``inv_freq`` tables, a few floats, which no checkpoint holds -- are moved over.
* random init (``--allow-random-init``): the tower is built under a ``torch.device`` context, so each parameter
  is allocated and initialised where it lives. On the CPU that is the build as it always was: the same
  generator, the same draws in the same order. On a GPU the initialisers draw from the GPU's generator, as
  megatron's own parameters are initialised there (seeded alike on every rank by ``runtime.init_megatron``, so
  DP replicas agree). Its buffers are then replaced by the host's computation, so that every buffer equals the
  CPU build's whatever the device computes a power with.

The device is the process's (``runtime.device()``), or the CPU where the builder keeps parameters in host
memory (``cpu_init``: export). On the device audit's stand-in device (``testing.device_audit``) the parameters
are stand-in tensors from birth, which ``tests/test_startup.py`` checks.
"""

from __future__ import annotations

import contextlib

import torch


def built_on(encoder_class: type, device: torch.device, *, from_checkpoint: bool) -> type:
    """The ``ModuleSpec.module`` that builds ``encoder_class(**params)`` on ``device`` (:func:`build_tower`).

    megatron calls the spec's ``module`` with its params; this class's ``__new__`` returns the tower itself (an
    ``encoder_class`` instance, so Python skips this class's ``__init__``). The name is the tower's, for megatron's
    log lines."""

    def build(cls, **params):
        return build_tower(encoder_class, params, device=device, from_checkpoint=from_checkpoint)

    return type(encoder_class.__name__, (), {"__new__": build, "__doc__": f"{encoder_class.__name__}, built on {device}"})


def build_tower(encoder_class: type, params: dict, *, device: torch.device, from_checkpoint: bool) -> torch.nn.Module:
    """``encoder_class(**params)`` on ``device`` (module docstring): uninitialised parameters for a checkpoint to
    fill (``from_checkpoint``), else initialised ones; buffers as the host computes them."""
    device = torch.device(device)
    if from_checkpoint:
        tower, buffers = _skeleton(encoder_class, params)
        tower.to_empty(device=device)
    else:
        with torch.device(device):
            tower = encoder_class(**params)
        if device.type == "cpu":
            return tower  # its buffers are the host's computation
        buffers = _skeleton(encoder_class, params)[1]
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        tower.get_submodule(owner)._buffers[leaf] = value.to(device)
    return tower


def _skeleton(encoder_class: type, params: dict) -> tuple[torch.nn.Module, dict]:
    """``(tower, its buffers)``: the tower built with every parameter on the meta device and nothing initialised
    (no generator touched), its buffers in host memory as its own code computes them."""
    from transformers.initialization import no_init_weights

    with torch.random.fork_rng(devices=[]), no_init_weights(), _parameters_on_meta():
        tower = encoder_class(**params)
    return tower, dict(tower.named_buffers())


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers goes to the meta device (what it was made with is dropped unread: a
    checkpoint fills it); buffers stay where they were made. ``nn.Module.register_parameter`` is where both
    ``self.weight = Parameter(...)`` and ``register_parameter`` end, so that is where this takes them; only the
    building thread builds modules meanwhile."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = type(param)(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
