"""Which Gated DeltaNet kernels megatron's GatedDeltaNet calls in this process, bound where it looks them up.

megatron-core 0.19.2's ``gated_delta_net.common`` imports fla's ``causal_conv1d``, ``l2norm`` and
``chunk_gated_delta_rule`` (or ``None``) into its globals and sets ``HAVE_FLA``, which the layer's
constructor checks; ``gdn`` copies ``causal_conv1d`` and ``chunk_gated_delta_rule`` from it at import, and
the package ``__init__`` re-exports all four. :func:`install` rebinds every one of those names that
exists, by the rule of ``mimo_sft.gdn_path`` (fla where it is installed and correct, else the torch
kernels of ``model.gdn_kernels``):

* **torch**: the three torch kernels, and ``HAVE_FLA`` true so that megatron builds the layer. On a
  machine without a CUDA GPU megatron's ``torch.compile``d helpers also run eagerly
  (:func:`_run_helpers_eagerly`).
* **fla**: fla's own functions, the convolution and the rule wrapped (:func:`_with_device_bounds`) so
  that they get a device copy of a host ``cu_seqlens``. The forward step keeps ``cu_seqlens`` on the
  host (``train.packing``): megatron's GDN arithmetic on them (``_resolve_cu_seqlens``: ``.item()``,
  ``.any()``, ``torch.equal``) then reads host memory, no device sync; fla's triton kernels need them
  on the device. The copy is made once per micro-batch (kept on the host tensor, pinned, asynchronous)
  and every layer gets the same device tensor, so fla's own per-tensor caches (its ``tensor_cache``, by
  identity) hit from the second layer on; fla also gets the host tensor as ``cu_seqlens_cpu`` where its
  function takes one (its chunk indices are then computed from host memory).

Call :func:`install` before building a model: the constructor picks ``chunk_gated_delta_rule`` when it
runs. :func:`installed_choice` says what the last install chose (the banner, ``check-model``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import replace
from typing import Optional

import torch

from mimo_sft.gdn_path import GdnChoice, GdnFacts, choose, fla_version, local_choice, local_facts
from mimo_sft.model import gdn_kernels as gk

_MEGATRON_MODULES = ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net.gdn",
                     "megatron.core.ssm.gated_delta_net")
_TORCH = {"causal_conv1d": gk.causal_conv1d, "l2norm": gk.l2norm, "chunk_gated_delta_rule": gk.chunk_gated_delta_rule}
#: what megatron imported (fla's functions and its HAVE_FLA), kept before the first rebinding
_ORIGINALS: dict = {}
_INSTALLED: list = []  # [the last GdnChoice installed]


def installed_choice() -> Optional[GdnChoice]:
    """The choice of the last :func:`install` in this process (None: no GDN model built here)."""
    return _INSTALLED[-1] if _INSTALLED else None


def current_choice() -> GdnChoice:
    """What this process runs: the installed choice, or, where no GDN layer was built here (a vision-only
    rank), what an install here would pick (the banner)."""
    return installed_choice() or local_choice()


def _ours(fn) -> bool:
    return fn is gk.chunk_gated_delta_rule or getattr(fn, "_mimo_device_bounds", False)


def _megatron_originals(common) -> dict:
    """fla's functions as megatron imported them (None where fla is absent), whatever was bound since."""
    if not _ours(common.chunk_gated_delta_rule):
        _ORIGINALS.clear()
        _ORIGINALS.update(HAVE_FLA=common.HAVE_FLA, causal_conv1d=common.causal_conv1d, l2norm=common.l2norm,
                          chunk_gated_delta_rule=common.chunk_gated_delta_rule)
    return _ORIGINALS


def install(facts: Optional[GdnFacts] = None) -> GdnChoice:
    """Bind the kernels :func:`mimo_sft.gdn_path.choose` picks (see the module docstring); idempotent.

    ``facts``: the machine's facts (default: this machine's, ``gdn_path.local_facts``); fla counts as
    installed only where megatron imported it."""
    import mimo_sft.parallel  # noqa: F401  (makes megatron importable without triton)

    common = importlib.import_module(_MEGATRON_MODULES[0])
    original = _megatron_originals(common)
    has_fla = bool(original["HAVE_FLA"]) and original["chunk_gated_delta_rule"] is not None
    if facts is None:
        facts = local_facts(fla=(fla_version() or "unknown") if has_fla else None)
    elif not has_fla:
        facts = replace(facts, fla=None)
    choice = choose(facts)
    if choice.uses_fla:
        bound = {"causal_conv1d": _with_device_bounds(original["causal_conv1d"]), "l2norm": original["l2norm"],
                 "chunk_gated_delta_rule": _with_device_bounds(original["chunk_gated_delta_rule"]),
                 "HAVE_FLA": True}
    else:
        bound = {**_TORCH, "HAVE_FLA": True}
    for name in _MEGATRON_MODULES:
        module = importlib.import_module(name)
        for attr, value in bound.items():
            if attr in vars(module):
                setattr(module, attr, value)
    if choice.uses_fla or facts.capability is not None:
        _restore_compiled_helpers()
    else:
        _run_helpers_eagerly()
    _install_cp_permutation()
    _INSTALLED[:] = [choice]
    return choice


def _install_cp_permutation() -> None:
    """Under context parallelism (``model.context_parallel``) megatron's GatedDeltaNet builds its sequence
    permutation from ``cu_seqlens`` (``_build_thd_cp_a2a_perm``) in every layer and indexes its activations with
    it. The forward step keeps ``cu_seqlens`` on the host, so the permutation would be a host index into device
    activations (an error on a GPU). Bound on both paths: the same function, its result copied to the process's
    device once per micro-batch (kept on the host tensor) and shared by every GDN layer."""
    gdn = importlib.import_module(_MEGATRON_MODULES[1])
    original = gdn._build_thd_cp_a2a_perm
    if getattr(original, "_mimo_on_device", False):
        return

    def on_device(cu_seqlens, cp_size, t_global):
        from mimo_sft.parallel import runtime

        return gk._cached(cu_seqlens, ("cp permutation", cp_size, t_global), lambda: tuple(
            runtime.host_to(t, runtime.device()) for t in original(cu_seqlens, cp_size, t_global)))

    on_device._mimo_on_device = True
    gdn._build_thd_cp_a2a_perm = on_device


# ---- fla with a device copy of host cu_seqlens ------------------------------------------------------
def device_bounds(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` on ``device``: one copy per micro-batch (kept on the host tensor), pinned and
    asynchronous where CUDA is present (a pageable copy would wait for the queued work)."""

    def copy():
        pinned = cu_seqlens.pin_memory() if torch.cuda.is_available() else cu_seqlens
        return pinned.to(device, non_blocking=True)

    return gk._cached(cu_seqlens, ("device", torch.device(device)), copy)


def _with_device_bounds(fla_fn):
    """fla's ``fla_fn`` called with a device ``cu_seqlens`` (and the host one, int64, as ``cu_seqlens_cpu``
    where it takes that argument: fla then counts its chunks on the host, without the device sync its
    ``repeat_interleave`` would cost) when megatron hands it a host tensor; otherwise called as it is."""
    takes_host = "cu_seqlens_cpu" in inspect.signature(fla_fn).parameters

    @functools.wraps(fla_fn)
    def call(*args, cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
        if cu_seqlens is not None:
            device = (args[0] if args else kwargs.get("x", kwargs.get("q"))).device
            if cu_seqlens.device != device:
                if takes_host and kwargs.get("cu_seqlens_cpu") is None:  # int64, as fla declares it; one per
                    kwargs["cu_seqlens_cpu"] = gk._cached(cu_seqlens, ("int64",), cu_seqlens.long)  # micro-batch
                cu_seqlens = device_bounds(cu_seqlens, device)
        return fla_fn(*args, cu_seqlens=cu_seqlens, **kwargs)

    call._mimo_device_bounds = True
    return call


# ---- megatron's compiled helpers --------------------------------------------------------------------
#: megatron's ``jit_fuser`` (``torch.compile``) helpers on Qwen3.5's path: ``(module, class, method)``
_COMPILED_HELPERS = (("megatron.core.ssm.gated_delta_net.common", "_GDNBase", "_prepare_input_for_gated_delta_rule"),
                     ("megatron.core.ssm.gated_delta_net.common", "_GDNBase", "_compute_g_and_beta"),
                     ("megatron.core.ssm.gated_delta_net.common", "_GDNBase", "_apply_gated_norm"),
                     ("megatron.core.transformer.attention", "Attention", "_apply_output_gate"))
_COMPILED: dict = {}


def _run_helpers_eagerly() -> None:
    """On a machine without a CUDA GPU, megatron's compiled helpers run as plain functions.

    Why: inductor compiles them on the CPU in ~12 s per process and again for each new sequence
    length until shapes go dynamic (measured: 11 s and 10 s for the first two lengths of a tiny model,
    against 0.3 s eager), every rank of every CPU run; the numbers are the same functions'. A GPU run
    keeps megatron's compiled ones (what the memory forecast counts: :func:`compiled_helpers`)."""
    for module, cls, name in _COMPILED_HELPERS:
        owner = getattr(importlib.import_module(module), cls)
        fn = owner.__dict__[name]
        original = getattr(fn, "_torchdynamo_orig_callable", None)
        if original is not None:
            _COMPILED[(module, cls, name)] = fn
            setattr(owner, name, original)


def _restore_compiled_helpers() -> None:
    """megatron's compiled helpers back where :func:`_run_helpers_eagerly` took them out."""
    for (module, cls, name), fn in _COMPILED.items():
        setattr(getattr(importlib.import_module(module), cls), name, fn)


@contextlib.contextmanager
def compiled_helpers():
    """megatron's compiled helpers back for the duration (``testing.saved_bytes``: what a GPU run keeps)."""
    owners = {key: getattr(importlib.import_module(key[0]), key[1]) for key in _COMPILED}
    eager = {key: owner.__dict__[key[2]] for key, owner in owners.items()}
    for key, owner in owners.items():
        setattr(owner, key[2], _COMPILED[key])
    try:
        yield
    finally:
        for key, owner in owners.items():
            setattr(owner, key[2], eager[key])
