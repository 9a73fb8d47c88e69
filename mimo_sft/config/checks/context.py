"""What every check reads (``CheckContext``) and returns (``Problem``), and the small helpers several
concerns share (the checked model's family, rank ranges, local paths). Pure: no torch, no megatron."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from mimo_sft.config import families
from mimo_sft.config.families import FamilySpec
from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.parallel.components import ComponentSpec
from mimo_sft.parallel.layout import Layout


@dataclass(frozen=True)
class Problem:
    check: int
    message: str
    severity: str = "error"  # "error" refuses the run; "note" is printed only

    def __str__(self) -> str:
        return f"[{self.check:02d}] {self.message}"


@dataclass
class CheckContext:
    cfg: ExperimentConfig
    specs: list[ComponentSpec]
    layout: Layout | None
    world_size: int | None
    for_run: bool
    hf_config: dict | None
    #: check 23's forecast (``memory.check``, JSON-ready); ``workload``: plan's heaviest micro-batch, if any
    memory: dict | None = None
    workload: object = None
    #: check 23's forecaster (``memory.check.forecast_check``): given by ``mimo_sft.validate``, so that config/
    #: never imports memory/ (memory/ reads config/'s schema)
    forecaster: Callable | None = None


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def model_type_of(ctx) -> str | None:
    return (ctx.hf_config or {}).get("model_type")


def family_spec(ctx) -> FamilySpec:
    """The family of ``--hf-model``'s config.json; the default family without one or for an unsupported
    ``model_type`` (check 16 refuses that), so the layout is still checked against a family's limits."""
    return families.family_for_model_type(model_type_of(ctx)) or families.default_family()


def rank_ranges(values: list[int]) -> str:
    out, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(out)


def read_hf_config(path: str | None) -> dict | None:
    if not path:
        return None
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def looks_local(path: str) -> bool:
    """A path rather than a hub dataset name ("org/name")."""
    return (path.startswith((".", "/", "~")) or path.endswith((".parquet", ".json", ".jsonl", ".arrow"))
            or path.count("/") != 1 or os.path.isdir(path.split("/")[0]))
