"""transformers' own model of a Qwen-VL folder, with a fine-tuned checkpoint's weights put in it in memory.

Why transformers' model and not ours: ``mimo-sft generate`` must answer exactly as transformers'
``generate`` answers on the folder ``mimo-sft export`` would write, and the one way to be sure of that
is to be that model. So the weights are the export's (``model.export.hf_weight_groups``: the same
conversion, names and dtype, one group at a time) and they reach the model through transformers'
own loading (``from_pretrained(None, config=..., state_dict=...)``: its renames and weight
conversions, tied weights, buffers), with the config an export writes (the source's, its dtype set),
and the source's ``generation_config.json`` as ``from_pretrained`` of the folder would read it.
Nothing is written to disk. Host memory: the model's weights, which transformers takes over without a
copy (they are already in its dtype), plus one group while it is converted.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from mimo_sft.errors import UserError


def _model_class():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def _class_for(config):
    """The class ``AutoModelForImageTextToText`` picks for ``config`` (the auto class itself needs a folder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


def exported_config(src_hf_dir: str, dtype: torch.dtype):
    """The transformers config of the folder an export of a checkpoint on ``src_hf_dir`` writes: the
    source's config.json with its dtype set (``model.export.config_with_dtype``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from mimo_sft.model.export import config_with_dtype
    from mimo_sft.model.hf_checkpoint import read_config_json

    raw = config_with_dtype(read_config_json(src_hf_dir), dtype)
    model_type = raw.get("model_type")
    try:  # what from_pretrained does with a folder's config.json
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except (ValueError, KeyError) as err:
        raise UserError(f"--hf-model {src_hf_dir}: transformers cannot read its config.json as model type "
                        f"{model_type!r} ({err})") from None


def model_from_groups(src_hf_dir: str, groups: Iterable[dict], dtype: torch.dtype):
    """transformers' model (eval mode, host memory) of ``src_hf_dir``'s architecture holding the tensors of
    ``groups`` (``{name as an exported file spells it: tensor in dtype}``, as ``hf_weight_groups`` yields
    them), loaded as ``from_pretrained`` loads an exported folder."""
    state: dict = {}
    for group in groups:
        state.update(group)
    config = exported_config(src_hf_dir, dtype)
    model, info = _class_for(config).from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                     output_loading_info=True)
    del state
    missing = sorted(info.get("missing_keys") or [])
    assert not missing, f"generate: weights missing from the converted checkpoint: {missing[:3]}"
    _read_generation_config(model, src_hf_dir)
    return model.eval()


def _read_generation_config(model, folder: str) -> None:
    """``generation_config.json`` of ``folder`` (end-of-turn tokens, the folder's defaults), where
    ``from_pretrained(folder)`` would read it; without one the model keeps the config's."""
    from transformers import GenerationConfig

    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder)


def model_from_folder(folder: str, dtype: torch.dtype | str = "auto", *, flag: str = "--hf-model"):
    """transformers' model of a Hugging Face folder as ``from_pretrained`` loads it (eval mode, host memory)."""
    try:
        return _model_class().from_pretrained(folder, dtype=dtype).eval()
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{flag} {folder}: transformers cannot load its weights ({first})") from None
