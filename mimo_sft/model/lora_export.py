"""Export a LoRA run: merged into a Hugging Face folder, or as a PEFT adapter folder.

Both start from the same single-process TP-1 model: the base weights read from the source HF
folder, LoRA applied with the checkpoint's settings, and the checkpoint's tensors loaded on top by
the caller (``mimo_sft.export`` joins this with ``train.checkpoint``; model/ never imports train/).

* merged: ``model.lora.merge_lora`` folds ``scaling * B A`` into each weight, then the ordinary
  HF writer (``model.export.export_model``) runs: the folder loads in transformers as any export.
* ``--adapter-only``: ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's format for
  ``Qwen2_5_VLForConditionalGeneration``. megatron fuses layers that HF keeps apart, and one fused
  LoRA is exactly several PEFT LoRAs that share A: ``linear_qkv`` -> ``q_proj``/``k_proj``/``v_proj``
  (B's rows split per query group as the weight's are, ``decoder_weights.split_qkv``),
  ``linear_fc1`` -> ``gate_proj``/``up_proj`` (B = [gate; up]), ``linear_proj`` -> ``o_proj``,
  ``linear_fc2`` -> ``down_proj``; vision layers keep their HF names. ``target_modules`` is a regex
  naming exactly the adapted modules (the vision MLP reuses the language MLP's names).
  Only adapters can be written this way: a run that also trained base weights (an unfrozen vision
  tower or projector) is refused with what to do instead.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch

from mimo_sft.config.lora import LoraSpec
from mimo_sft.errors import UserError
from mimo_sft.model.decoder_weights import split_qkv
from mimo_sft.parallel.layout import IMAGES

PEFT_PREFIX = "base_model.model."
LANGUAGE_PATH = "model.language_model.layers.{i}."
VISION_PATH = "model.visual."


def build_lora_model(src_hf_dir: str, lora: dict):
    """The 1-rank TP-1 model of ``src_hf_dir`` (its HF weights, host memory) with the adapters of a
    checkpoint whose meta.json ``"lora"`` entry is ``lora``; the caller loads the checkpoint into it."""
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.hf_checkpoint import HFCheckpoint
    from mimo_sft.model.lora import apply_lora

    try:
        HFCheckpoint(src_hf_dir)
    except UserError:
        raise UserError(f"--hf-model {src_hf_dir}: a LoRA checkpoint holds only its adapters; its base weights "
                        f"(*.safetensors) must be in this folder") from None
    spec = LoraSpec.from_dict(lora)
    mc = ModelConfig(freeze_vision=bool(lora.get("freeze_vision")), freeze_projector=bool(lora.get("freeze_projector")),
                     freeze_language=bool(lora.get("freeze_language")))
    model, info = build_single_process_model(src_hf_dir, random_init=False, model_cfg=mc, prefer="cpu", cpu_init=True)
    apply_lora(model, spec, seed=0)  # initial values are overwritten by the checkpoint's
    return model, info, spec


def export_lora(load_weights: Callable[[torch.nn.Module], None], src_hf_dir: str, out_dir: str, lora: dict, *,
                adapter_only: bool = False, dtype: torch.dtype | None = None) -> dict:
    """Write ``out_dir`` from a LoRA checkpoint: merged HF folder (in ``dtype``), or (``adapter_only``) a PEFT folder."""
    from mimo_sft.model.export import export_model
    from mimo_sft.model.lora import merge_lora

    model, info, spec = build_lora_model(src_hf_dir, lora)
    load_weights(model)
    if adapter_only:
        return write_peft_adapter(model, info, spec, src_hf_dir, out_dir)
    merge_lora(model)
    return export_model(model, src_hf_dir, out_dir, dtype=dtype)


def _trained_base(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and not n.endswith((".lora_a", ".lora_b"))]


def peft_tensors(model, info) -> tuple[dict, list[str]]:
    """PEFT's ``adapter_model.safetensors`` tensors of a TP-1 LoRA ``MimoModel`` and the HF module
    paths they adapt."""
    t = info.hf_config.text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    groups, hpg = t.num_key_value_heads, t.num_attention_heads // t.num_key_value_heads
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []

    def put(path: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().clone().contiguous()
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach().clone().contiguous()
        modules.append(path)

    lm = model.language_model
    for i, layer in enumerate(lm.decoder.layers if lm is not None else ()):
        base = LANGUAGE_PATH.format(i=i)
        att, mlp = layer.self_attention, layer.mlp
        if hasattr(att.linear_qkv, "lora_a"):
            q, k, v = split_qkv(att.linear_qkv.lora_b, groups, head_dim, hpg)
            for name, b in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                put(base + "self_attn." + name, att.linear_qkv.lora_a, b)
        if hasattr(att.linear_proj, "lora_a"):
            put(base + "self_attn.o_proj", att.linear_proj.lora_a, att.linear_proj.lora_b)
        if hasattr(mlp.linear_fc1, "lora_a"):
            gate, up = torch.chunk(mlp.linear_fc1.lora_b, 2, dim=0)
            put(base + "mlp.gate_proj", mlp.linear_fc1.lora_a, gate)
            put(base + "mlp.up_proj", mlp.linear_fc1.lora_a, up)
        if hasattr(mlp.linear_fc2, "lora_a"):
            put(base + "mlp.down_proj", mlp.linear_fc2.lora_a, mlp.linear_fc2.lora_b)
    if IMAGES in model.modality_submodules:
        for enc in model.modality_submodules[IMAGES].encoders.values():
            for name, module in enc.named_modules():
                if hasattr(module, "lora_a"):
                    put(VISION_PATH + name, module.lora_a, module.lora_b)
    return out, modules


def target_regex(modules: list[str]) -> str:
    """A regex PEFT full-matches against module names that names exactly ``modules`` (every layer has
    the same targets, so layer numbers collapse to ``\\d+``)."""
    shapes = sorted({re.sub(r"\.(layers|blocks)\.\d+\.", r".\1.N.", m) for m in modules})
    return "|".join(re.escape(m).replace(r"\.N\.", r"\.\d+\.") for m in shapes)


def write_peft_adapter(model, info, spec: LoraSpec, src_hf_dir: str, out_dir: str) -> dict:
    """``adapter_config.json`` + ``adapter_model.safetensors`` that ``PeftModel.from_pretrained`` loads
    onto the HF model of ``src_hf_dir``."""
    from safetensors.torch import save_file

    trained = _trained_base(model)
    if trained:
        raise UserError(f"--adapter-only: the run also trained {len(trained)} base tensors (e.g. {trained[0]}), "
                        f"which a PEFT adapter cannot hold; export merged (without --adapter-only), or train "
                        f"with --freeze-vision --freeze-projector (or LoRA targets vision_attn,vision_mlp,merger)")
    tensors, modules = peft_tensors(model, info)
    if os.path.abspath(out_dir) == os.path.abspath(src_hf_dir):
        raise UserError(f"export target {out_dir} is the source folder; choose a new --out folder")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": os.path.abspath(src_hf_dir),
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
        "target_modules": target_regex(modules), "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return {"out_dir": out_dir, "tensors": len(tensors), "modules": len(modules)}
