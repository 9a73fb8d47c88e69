"""What a LoRA run's checkpoint holds, and which checkpoints a LoRA run may start from.

A LoRA checkpoint's ``model/`` holds only the tensors that train (adapters, plus whatever the
freeze flags leave trainable), so it is small; ``meta.json`` names the base model (``hf_model``)
and records the LoRA settings and freeze flags (``"lora"``). Loading builds the base model from
the HF weights as usual and reads the checkpoint's tensors on top of it. The optimizer state's keys
follow the model's (``optimizer`` builds its map from the same filtered state dict).

Kept apart from ``checkpoint.py`` so that full fine-tuning's code path reads as before; these
helpers only act where the model has adapters or the checkpoint says it was a LoRA run.
"""

from __future__ import annotations

import torch

from mimo_sft.config.lora import LoraSpec
from mimo_sft.errors import UserError
from mimo_sft.model.lora import has_lora  # noqa: F401 - re-exported for checkpoint.py

_ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


def _trainable(entry) -> bool:
    data = getattr(entry, "data", None)
    return isinstance(data, torch.Tensor) and data.requires_grad


def trainable_entries(sd: dict) -> dict:
    """The entries of a flat model sharded state dict whose parameter trains (drops frozen base
    weights and ``_extra_state`` objects)."""
    return {k: v for k, v in sd.items() if _trainable(v)}


def stored_under(entry) -> set:
    """The checkpoint keys a model sharded-state-dict entry is written under: its own key, or a factory's
    parts' keys -- fc1's swiglu factory keeps its key, a Gated DeltaNet's ``in_proj`` weight and LoRA B
    are written as ``KEY.query``, ``KEY.key``, ... (megatron's ``_split_tensor_factory``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        return {part.key for part in nested_values(entry.build())}
    key = getattr(entry, "key", None)
    return {key} if key is not None else set()


def is_stored(entry, present: set) -> bool:
    """Whether a checkpoint whose tensor keys are ``present`` holds the whole of ``entry``."""
    keys = stored_under(entry)
    return bool(keys) and keys <= present


def lora_load_entries(sd: dict, folder: str, *, pretrained: bool) -> tuple[dict, list[str]]:
    """(entries of ``sd`` the checkpoint in ``folder`` holds, state-dict keys that must be loaded).

    Resuming needs every tensor that trains. Starting from weights (``pretrained``) needs the
    adapters of a LoRA checkpoint (whatever else it holds is loaded, the rest stays the base's), or
    the base weights of a full fine-tuning checkpoint (the adapters start fresh).
    """
    from mimo_sft.train.checkpoint.trusted import stored_tensor_keys

    present = stored_tensor_keys(folder)
    entries = {k: v for k, v in sd.items() if is_stored(v, present)}
    if not pretrained:
        return entries, [k for k, v in sd.items() if _trainable(v)]
    has_adapters = any(key.endswith(_ADAPTER_SUFFIXES) for key in present)
    tensors = [k for k, v in sd.items() if isinstance(getattr(v, "data", None), torch.Tensor)]
    return entries, [k for k in tensors if k.endswith(_ADAPTER_SUFFIXES) == has_adapters]


def lora_meta(model_cfg) -> dict:
    """``{"lora": {...}}`` for meta.json of a LoRA run (its spec and freeze flags), else ``{}``."""
    spec = LoraSpec.from_model_config(model_cfg)
    if spec is None:
        return {}
    return {"lora": {**spec.to_dict(), "freeze_vision": bool(model_cfg.freeze_vision),
                     "freeze_projector": bool(model_cfg.freeze_projector),
                     "freeze_language": bool(model_cfg.freeze_language)}}


def check_lora_compatible(meta: dict, model_cfg, *, path: str, resume: bool) -> None:
    """Refuse, with what to change, a checkpoint whose LoRA settings this run cannot load (check 20 says the same
    before any process starts: ``config.lora.recorded_lora_problems``)."""
    from mimo_sft.config.lora import recorded_lora_problems

    problems = recorded_lora_problems(meta.get("lora"), model_cfg, path=path, resume=resume)
    if problems:
        raise UserError(problems[0], problems=problems)
