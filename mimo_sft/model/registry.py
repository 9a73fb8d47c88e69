"""The adapter of each registered model family, found through its descriptor.

``config.families`` holds the descriptors (``FamilySpec``); each names its adapter class
(``adapter="module:Class"``), imported here the first time a model of that family is built. The
adapters import ``model.family`` (the protocol) and their descriptor, never this module, so the
import graph has no cycle: registry -> adapter -> family.
"""

from __future__ import annotations

import importlib

from mimo_sft.config import families
from mimo_sft.errors import UserError
from mimo_sft.model.family import FamilyAdapter

_ADAPTERS: dict[str, FamilyAdapter] = {}


def adapter_for(spec: families.FamilySpec) -> FamilyAdapter:
    """The (one) adapter instance of ``spec``'s family."""
    if spec.name not in _ADAPTERS:
        module, _, cls = spec.adapter.partition(":")
        adapter = getattr(importlib.import_module(module), cls)()
        assert isinstance(adapter, FamilyAdapter) and adapter.spec is spec, (
            f"{spec.adapter} is not the FamilyAdapter of family {spec.name}")
        _ADAPTERS[spec.name] = adapter
    return _ADAPTERS[spec.name]


def supported_families() -> list[str]:
    return sorted(families.family_names())


def get_family(raw_config: dict, *, hf_dir: str, requested: str = "auto") -> FamilyAdapter:
    """The adapter for a config.json, by its ``model_type`` (UserError listing the supported ones).

    A ``UserError`` rather than an assertion: export and check-model read a checkpoint without
    running ``check_config`` first.
    """
    model_type = raw_config.get("model_type")
    spec = families.family_for_model_type(model_type)
    if spec is None:
        raise UserError(families.unsupported_model_type(model_type, f"{hf_dir}/config.json"))
    mismatch = families.family_mismatch(requested, model_type, f"{hf_dir}/config.json")
    if mismatch:
        raise UserError(mismatch)
    return adapter_for(spec)
