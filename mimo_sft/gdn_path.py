"""Which Gated DeltaNet kernels a machine runs: fla's triton kernels, or mimo-sft's torch ones.

Why a rule: fla (flash-linear-attention) is megatron's kernel library for Qwen3.5's linear-attention
layers, but on Hopper GPUs (compute capability 9.x) triton from 3.4.0 up to (not including) 3.7.1
compiles fla's gated ``chunk_bwd_dqkwg`` backward wrongly (fla issue #640). fla releases since 0.5.0
refuse that backward there unless their tilelang backend can take it (0.5.0 and 0.5.1 refuse every
triton from 3.4.0, the later ones only below 3.7.1); releases before 0.5.0 have neither the refusal nor
the tilelang backend, so they would compute wrong gradients without a word. A training run there must
not reach fla's backward at all, so the whole process takes the torch kernels
(``model.gdn_kernels``) instead; everywhere else fla runs. The rule is :func:`choose`, a pure function
of :class:`GdnFacts`; :func:`local_facts` reads them on this machine.

fla's tilelang backend is counted as usable when tilelang is installed, an ``nvcc`` binary is found
(tilelang compiles its kernels with it; fla looks for one the same ways) and ``FLA_TILELANG`` is not
``0``. A tilelang whose compile then fails makes fla raise, not compute wrongly.

Pure and cheap: no torch at import, and :func:`local_facts` imports torch only where a CUDA driver is
present or torch is already imported (``validate`` stays fast on a laptop), and reads versions from
package metadata, so neither fla nor triton is imported. Tested on the CPU by its rule only
(``tests/test_gdn_path.py``); no choice has been measured on a GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FLA = "fla"
TORCH = "torch"
#: triton versions that compile fla's gated backward wrongly on Hopper: [first, fixed)
TRITON_BAD, TRITON_FIXED = (3, 4, 0), (3, 7, 1)
#: the fla release that added the refusal and the tilelang backend, and the one that lifted the
#: refusal for fixed triton
FLA_TILELANG, FLA_KNOWS_FIX = (0, 5, 0), (0, 5, 2)
#: the rule in words (``validate`` says it beside this machine's answer: the run may start elsewhere)
RULE = ("fla where it is installed on a CUDA GPU, except on Hopper (sm 9x) with triton 3.4.0 to 3.7.0 and no "
        "usable tilelang, where its gated backward is wrong; there, and without fla or a GPU, the torch kernels")
#: where a CUDA toolkit is looked for when neither ``CUDA_HOME`` nor ``CUDA_PATH`` is set
DEFAULT_CUDA_HOME = "/usr/local/cuda"


def version_tuple(text: Optional[str]) -> Optional[tuple[int, int, int]]:
    """``"3.6.0+cu130"`` -> ``(3, 6, 0)``; missing parts are 0; None for None or a text without a number."""
    if not text:
        return None
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if not match:
        return None
    return tuple(int(p or 0) for p in match.groups())  # type: ignore[return-value]


@dataclass(frozen=True)
class GdnFacts:
    """What the choice depends on: fla's version (None: not installed; ``"unknown"``: importable without
    package metadata), CUDA device 0's compute capability (None: no CUDA GPU), triton's version (None:
    not installed) and whether fla's tilelang backend is usable."""

    fla: Optional[str]
    capability: Optional[tuple[int, int]]
    triton: Optional[str]
    tilelang: bool

    def text(self) -> str:
        gpu = f"sm {self.capability[0]}{self.capability[1]}" if self.capability else "no CUDA GPU"
        return (f"{gpu}, fla {self.fla or 'not installed'}, triton {self.triton or 'not installed'}, "
                f"tilelang {'usable' if self.tilelang else 'not usable'}")


@dataclass(frozen=True)
class GdnChoice:
    """The kernels a process runs (:data:`FLA` or :data:`TORCH`) and why, in words."""

    kernels: str
    reason: str

    @property
    def uses_fla(self) -> bool:
        return self.kernels == FLA

    def line(self) -> str:
        """One line for the banner, ``validate`` and ``check-model``."""
        name = "fla's kernels" if self.uses_fla else "mimo-sft's torch kernels (model.gdn_kernels)"
        return f"Gated DeltaNet: {name}: {self.reason}"


def _hopper_fault(facts: GdnFacts) -> Optional[str]:
    """Why fla's gated backward cannot be trusted on this Hopper GPU, or None where it can."""
    triton = version_tuple(facts.triton)
    fla = version_tuple(facts.fla)
    if triton is None:
        return "triton is not installed (fla's kernels are triton)"
    if triton < TRITON_BAD:
        return None
    if facts.tilelang and fla is not None and fla >= FLA_TILELANG:
        return None
    if triton >= TRITON_FIXED and fla is not None and not FLA_TILELANG <= fla < FLA_KNOWS_FIX:
        return None
    where = f"Hopper (sm {facts.capability[0]}{facts.capability[1]}) with triton {facts.triton}"
    if triton >= TRITON_FIXED:  # fixed triton, but this fla still refuses it (or its version is unknown)
        return f"{where}: fla {facts.fla} refuses its gated backward on Hopper without tilelang"
    if fla is None:
        return f"{where}: fla's version is unknown, so its gated backward may be wrong there (fla #640)"
    without = "no usable tilelang" if fla >= FLA_TILELANG else f"fla {facts.fla}, which has no tilelang backend"
    return f"{where} and {without}: fla's gated backward is wrong there (fla #640)"


def choose(facts: GdnFacts) -> GdnChoice:
    """fla where it is installed, a CUDA GPU is present and its gated backward is correct; else torch."""
    if facts.fla is None:
        return GdnChoice(TORCH, "fla is not installed")
    if facts.capability is None:
        return GdnChoice(TORCH, "no CUDA GPU (fla's kernels are triton, GPU only)")
    sm = f"sm {facts.capability[0]}{facts.capability[1]}"
    if facts.capability[0] != 9:
        return GdnChoice(FLA, f"fla {facts.fla} on {sm}: not Hopper, where triton 3.4.0 to 3.7.0 miscompile its "
                              "gated backward")
    fault = _hopper_fault(facts)
    if fault is not None:
        return GdnChoice(TORCH, fault)
    triton = version_tuple(facts.triton)
    if triton < TRITON_BAD:
        why = f"triton {facts.triton} predates the Hopper fault (3.4.0 to 3.7.0)"
    elif facts.tilelang and version_tuple(facts.fla) >= FLA_TILELANG:
        why = f"triton {facts.triton} with fla's tilelang backward"
    else:
        why = f"triton {facts.triton} has the fix"
    return GdnChoice(FLA, f"fla {facts.fla} on Hopper ({sm}), {why}")


# ---- this machine ----------------------------------------------------------------------------------
def _installed_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def fla_version() -> Optional[str]:
    """fla's version where the ``fla`` package is importable (not imported here), else None."""
    if importlib.util.find_spec("fla") is None:
        return None
    return _installed_version("fla-core", "flash-linear-attention") or "unknown"


def _nvcc_found() -> bool:
    """An ``nvcc`` binary where tilelang's compile would look: ``CUDA_HOME`` / ``CUDA_PATH``, ``PATH``,
    the ``nvidia-cuda-nvcc`` wheel (only its 13.x releases ship the binary) or ``/usr/local/cuda``."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), DEFAULT_CUDA_HOME]
    if any(h and (Path(h) / "bin" / "nvcc").exists() for h in homes) or shutil.which("nvcc"):
        return True
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(Path(str(f)).name in ("nvcc", "nvcc.exe") for f in files)


def tilelang_usable() -> bool:
    """Whether fla's tilelang backend can run: tilelang installed, ``FLA_TILELANG`` not ``0``, an nvcc found."""
    if os.environ.get("FLA_TILELANG") == "0" or importlib.util.find_spec("tilelang") is None:
        return False
    return _nvcc_found()


def gpu_capability() -> Optional[tuple[int, int]]:
    """CUDA device 0's compute capability, or None without a usable CUDA GPU (torch is imported only where
    a CUDA driver is present or torch already is)."""
    if "torch" not in sys.modules and not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU here"
        return None
    return None


def local_facts(*, fla: Optional[str] = "probe") -> GdnFacts:
    """This machine's facts. ``fla``: the caller's knowledge of fla (megatron's import of it), else probed."""
    return GdnFacts(fla=fla_version() if fla == "probe" else fla, capability=gpu_capability(),
                    triton=_installed_version("triton", "pytorch-triton"), tilelang=tilelang_usable())


def local_choice() -> GdnChoice:
    """The choice on this machine (what a run started here would take)."""
    return choose(local_facts())


def validate_line() -> str:
    """``validate``'s note: this machine's choice and facts, then the rule (a run may start on other machines)."""
    facts = local_facts()
    return f"{choose(facts).line()} (this machine: {facts.text()}); the rule: {RULE}"
