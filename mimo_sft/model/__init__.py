"""Qwen-VL models on megatron-core's MimoModel: family adapters, weight conversion, assembly, export.

Public API (what train/ and cli.py call):

* ``build_mimo_model(hf_dir, *, layout, parallel_state, model_cfg, ...) -> (MimoModel, ModelInfo)``
* ``build_single_process_model(hf_dir, *, random_init=False, ...)`` (1-rank colocated, TP=1)
* ``modality_inputs_from_batch(batch, encoder_name)`` / ``ModelInfo.modality_inputs(batch)``
* ``export_hf(state_dict_tp1, src_hf_dir, out_dir)`` / ``export_model(model, src_hf_dir, out_dir)``
* ``export_weights(read_weights, src_hf_dir, out_dir)`` (streamed: a meta-device 1-rank model, ``read_weights(model, keys)``
  one layer at a time, shards as transformers writes them)
* ``check_model(hf_dir) -> dict``
* ``supported_families()``

Submodules import megatron lazily where they can, so ``import mimo_sft.model`` stays cheap.
"""

from mimo_sft.model.family import IMAGES, ModelInfo, modality_inputs_from_batch


def supported_families() -> list[str]:
    from mimo_sft.model.registry import supported_families as _f

    return _f()


def build_mimo_model(*args, **kwargs):
    from mimo_sft.model.builder import build_mimo_model as _f

    return _f(*args, **kwargs)


def build_single_process_model(*args, **kwargs):
    from mimo_sft.model.builder import build_single_process_model as _f

    return _f(*args, **kwargs)


def export_hf(*args, **kwargs):
    from mimo_sft.model.export import export_hf as _f

    return _f(*args, **kwargs)


def export_model(*args, **kwargs):
    from mimo_sft.model.export import export_model as _f

    return _f(*args, **kwargs)


def export_weights(*args, **kwargs):
    from mimo_sft.model.export import export_weights as _f

    return _f(*args, **kwargs)


def check_model(*args, **kwargs):
    from mimo_sft.model.check import check_model as _f

    return _f(*args, **kwargs)


__all__ = ["IMAGES", "ModelInfo", "modality_inputs_from_batch", "supported_families", "build_mimo_model",
           "build_single_process_model", "export_hf", "export_model", "export_weights", "check_model"]
