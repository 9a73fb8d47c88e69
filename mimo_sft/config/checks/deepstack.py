"""Check 31: DeepStack layers on the first language pipeline stage (registered in ``config.checks``).

Qwen3-VL's encoder sends, with each image token's main embedding, one DeepStack feature per entry of
``vision_config.deepstack_visual_indexes``; the language model adds feature j to the hidden states
at the image-token positions after decoder layer j (``model.deepstack``). Only the first language
pipeline stage receives the encoder's output across the bridge, so decoder layers ``0..k-1`` must
all be on it: megatron splits the layers evenly, ``layers / pp`` per stage.

Pure like the other checks; ``k`` and the layer count come from ``--hf-model``'s config.json (the
layer count through the family descriptor, as checks 16 and 21 read it).
"""

from __future__ import annotations

from mimo_sft.config import families
from mimo_sft.parallel.layout import LANGUAGE


def deepstack_layer_count(config: dict | None) -> int:
    """How many decoder layers (``0..k-1``) get DeepStack features: ``len(deepstack_visual_indexes)``
    of the config.json's ``vision_config`` (0 for a model without DeepStack)."""
    vision = (config or {}).get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes") or ())


def _layers(last: int) -> str:
    return "layer 0" if last == 0 else f"layers 0-{last}"


def _largest_pp(layers: int, k: int) -> int:
    """The largest pp that divides ``layers`` and keeps ``k`` layers on the first stage."""
    return max(p for p in range(1, layers + 1) if layers % p == 0 and layers // p >= k)


def c31_deepstack_stages(ctx):
    k = deepstack_layer_count(ctx.hf_config)
    lang = next((s for s in ctx.specs if s.name == LANGUAGE), None)
    if k == 0 or lang is None or lang.pp <= 1:
        return
    spec = families.family_for_model_type(ctx.hf_config.get("model_type")) or families.default_family()
    layers = spec.language_dims(ctx.hf_config).layers
    if not layers or layers % lang.pp:
        return  # check 16 refuses a pp that does not divide the layers
    first = layers // lang.pp
    if first >= k:
        return
    if layers < k:
        yield (f"--hf-model: config.json adds DeepStack features after decoder {_layers(k - 1)} "
               f"(vision_config.deepstack_visual_indexes has {k} entries) but the language model has "
               f"{layers} layers; fix the checkpoint's config.json")
        return
    yield (f"language.pp={lang.pp} puts decoder {_layers(first - 1)} on the first language pipeline stage, but "
           f"the model adds DeepStack features after {_layers(k - 1)} (vision_config.deepstack_visual_indexes), "
           f"which only that stage receives; set language.pp to at most {_largest_pp(layers, k)} in its "
           f"--component")
