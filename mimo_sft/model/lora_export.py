"""Export a LoRA run: merged into a Hugging Face folder, or as a PEFT adapter folder.

* merged (:func:`merged_weight_reader`): streamed as a full run's export is
  (``model.export.export_weights``), one group at a time -- a decoder layer, a vision block: its base
  weights read from the source HF folder, the checkpoint's tensors (what trained) on top, each adapter
  folded in as ``model.lora.merge_lora`` folds it (``W + scaling * B A`` in fp32). Host memory: one
  group and one shard, never the model; bit for bit the whole-model merge (tests/test_lora_e2e.py).
* ``--adapter-only`` (:func:`export_peft`): the 1-rank TP-1 model on the meta device with LoRA
  applied as the checkpoint's settings say, only the checkpoint's tensors (adapters, trained base
  weights) read into it by the caller's reader (``mimo_sft.train.export`` joins this with
  ``train.checkpoint``; model/ never imports train/), then ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's format for
  the family's transformers model (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``,
  ``Qwen3_5ForConditionalGeneration``). megatron fuses layers that HF keeps apart, and one fused
  LoRA is exactly several PEFT LoRAs that share A, B's rows split as the weight's rows are -- which
  the family's own weight export says (:func:`hf_layout`), so no layout is written twice: e.g.
  ``linear_qkv`` -> ``q_proj``/``k_proj``/``v_proj`` (per query group; Qwen3.5's q rows with their
  output-gate rows re-interleaved per head), a Gated DeltaNet's ``in_proj`` -> ``in_proj_qkv``/
  ``in_proj_z``/``in_proj_b``/``in_proj_a``, ``linear_fc1`` -> ``gate_proj``/``up_proj``; the
  row-parallel ones (``linear_proj``, ``out_proj``, ``linear_fc2``) map one to one. Vision layers keep
  their HF names. ``target_modules`` is a regex naming exactly the adapted modules (the vision MLP
  reuses the language MLP's names).
  Base weights that also trained (an unfrozen vision tower or projector, the default with LoRA) go
  in as PEFT ``modules_to_save``: the largest vision modules holding trained weights and no adapter
  (the whole tower, or its patch embedding and blocks when the merger has adapters, or the merger),
  written whole under their HF names, as PEFT itself saves them.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch

from mimo_sft.config.lora import LoraSpec
from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import IMAGES

PEFT_PREFIX = "base_model.model."
VISION_PATH = "model.visual."


def base_weights(src_hf_dir: str):
    """The source folder's weights (``HFCheckpoint``), which a LoRA checkpoint builds on."""
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    try:
        return HFCheckpoint(src_hf_dir)
    except UserError:
        raise UserError(f"--hf-model {src_hf_dir}: a LoRA checkpoint holds only its adapters; its base weights "
                        f"(*.safetensors) must be in this folder") from None


def build_lora_model(src_hf_dir: str, lora: dict):
    """The 1-rank TP-1 model of ``src_hf_dir`` (its HF weights, host memory) with the adapters of a
    checkpoint whose meta.json ``"lora"`` entry is ``lora``; the caller loads the checkpoint into it.
    The whole-model form the streamed exports are tested against (bit for bit), not used by them."""
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.lora import apply_lora

    base_weights(src_hf_dir)
    spec = LoraSpec.from_dict(lora)
    mc = ModelConfig(freeze_vision=bool(lora.get("freeze_vision")), freeze_projector=bool(lora.get("freeze_projector")),
                     freeze_language=bool(lora.get("freeze_language")))
    model, info = build_single_process_model(src_hf_dir, random_init=False, model_cfg=mc, prefer="cpu", cpu_init=True)
    apply_lora(model, spec, seed=0)  # initial values are overwritten by the checkpoint's
    return model, info, spec


def export_peft(read_stored: Callable, stored: Callable, src_hf_dir: str, out_dir: str, lora: dict) -> dict:
    """``--adapter-only``: write ``out_dir`` as a PEFT folder from a LoRA checkpoint, holding in host
    memory only what the checkpoint holds -- the adapters and the base weights that trained -- on the
    1-rank model built on the meta device (``read_stored`` / ``stored``: as :func:`merged_weight_reader`).
    A LoRA checkpoint holds exactly what trained, so that is what is marked trainable."""
    lora_model, info = _meta_lora_model(src_hf_dir, lora)
    held = sorted(stored(lora_model))
    tensors = read_stored(lora_model, held)
    for name, param in list(lora_model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        module = lora_model.get_submodule(owner) if owner else lora_model
        if name in tensors:
            module._parameters[leaf] = torch.nn.Parameter(tensors.pop(name), requires_grad=True)
        else:
            param.requires_grad_(False)
    return write_peft_adapter(lora_model, info, LoraSpec.from_dict(lora), src_hf_dir, out_dir)


def _meta_lora_model(src_hf_dir: str, lora: dict):
    """The 1-rank TP-1 model of ``src_hf_dir`` with the checkpoint's adapters, on the meta device (no
    memory: its state names, shapes and the checkpoint's keys), and its ``ModelInfo``."""
    from mimo_sft.model.export import meta_model
    from mimo_sft.model.lora import apply_lora

    model, info = meta_model(src_hf_dir)
    with torch.device("meta"):
        apply_lora(model, LoraSpec.from_dict(lora), seed=0)
    return model, info


def merged_weight_reader(read_stored: Callable, stored: Callable, src_hf_dir: str, lora: dict) -> Callable:
    """``read(model, keys)`` for ``model.export.export_weights``: a LoRA run's merged weights for those
    state keys of the 1-rank TP-1 model, one group (a decoder layer, a vision block) at a time -- the
    base weights read from ``src_hf_dir`` as the streamed load reads them, the tensors the checkpoint
    holds (``read_stored(model, keys)``; ``stored(model) -> set`` of the state keys it holds) on top,
    then each adapted weight ``W + scaling * B A`` in fp32, as ``model.lora.merge_lora`` folds it.
    Host memory: one group and its adapters, never the model.
    """
    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.lora import lora_modules
    from mimo_sft.model.registry import get_family

    base = base_weights(src_hf_dir)
    adapter = get_family(read_config_json(src_hf_dir), hf_dir=src_hf_dir)
    lora_model, info = _meta_lora_model(src_hf_dir, lora)  # the checkpoint's adapter keys; TP-1 config and vocab
    hf_cfg, padded_vocab = info.hf_config, info.padded_vocab_size
    vision_prefix = adapter._vision_prefix(base.prefix_style)
    scaling = {name: module.lora_scaling for name, module in lora_modules(lora_model)}
    held = stored(lora_model)

    def base_language(keys: list) -> dict:
        """The base weights of ``keys`` (GPTModel names): one decoder layer's, or the edges'."""
        layer = re.match(r"decoder\.layers\.(\d+)\.", keys[0])
        where = (dict(layer_offset=int(layer.group(1)), num_local_layers=1, pre_process=False, post_process=False)
                 if layer else dict(layer_offset=0, num_local_layers=0, pre_process=True, post_process=True))
        got: dict = {}
        for group in adapter.load_language(base, hf_cfg, tp_rank=0, tp=1, padded_vocab=padded_vocab, **where):
            got.update(group)
        if layer:
            got = {k.replace("decoder.layers.0.", f"decoder.layers.{layer.group(1)}.", 1): v for k, v in got.items()}
        return {k: got[k] for k in keys}

    def read(_model, keys: list) -> dict:
        language = [k for k in keys if k.startswith("language_model.")]
        out = {}
        if language:
            part = base_language([k[len("language_model."):] for k in language])
            out.update({"language_model." + k: v for k, v in part.items()})
        for k in keys:
            if k.startswith(f"modality_submodules.{IMAGES}.encoders."):  # the tower's names are HF's, under its prefix
                out[k] = base.read(vision_prefix + k.split(".", 4)[4])
        missing = [k for k in keys if k not in out]
        assert not missing, f"export: no base weight read for {missing[:3]}"
        adapted = {k: k[: -len(".weight")] for k in keys if k.endswith(".weight") and k[: -len(".weight")] in scaling}
        trained = [k for k in keys if k in held]
        stored_part = read_stored(lora_model, trained + [o + ab for o in adapted.values() for ab in (".lora_a", ".lora_b")])
        out.update({k: stored_part[k] for k in trained})
        for k, owner in adapted.items():
            delta = (stored_part[owner + ".lora_b"].float() @ stored_part[owner + ".lora_a"].float()) * scaling[owner]
            out[k] = out[k].float() + delta
        base.close()
        return out

    return read


def _trained_base(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and not n.endswith((".lora_a", ".lora_b"))]


#: the state-dict names transformers' own module tree has (``model.language_model.*``, ``model.visual.*``):
#: PEFT names the modules it wraps by them, whatever names the source checkpoint's files use
HF_MODULE_STYLE = "nested"


def hf_layout(adapter, hf_cfg, layer_state: dict, key: str, kind: str) -> dict[str, torch.Tensor]:
    """Where the family's own export (``adapter.export``) puts each row (``kind`` 'column') or column
    ('row') of the TP-1 megatron weight ``key`` of one decoder layer: ``{HF module path: the megatron
    row (column) numbers, in that module's order}``.

    Why a probe and not a table per family: a fused LoRA's B rows must split exactly as the fused
    weight's rows do (A's columns, for a row-parallel linear), and the family's export is that layout's
    one definition, tested against transformers. The layer is exported with every tensor a meta tensor
    except ``key``, replaced by its row (column) numbers: the HF tensors that come out real are the ones
    made from ``key``, and their values say which rows went where. ``layer_state``: the layer's tensors
    (or their meta stand-ins) under their ``GPTModel`` names."""
    n = layer_state[key].shape[0 if kind == "column" else 1]
    numbers = torch.arange(n, dtype=torch.float64)
    probe = numbers[:, None] if kind == "column" else numbers[None, :]
    part = {k: probe if k == key else torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in layer_state.items()}
    made = {name: t for name, t in adapter.export(part, {}, hf_cfg, prefix_style=HF_MODULE_STYLE).items()
            if not t.is_meta}
    assert made and all(name.endswith(".weight") for name in made), f"{key}: export made {sorted(made)}"
    assert kind == "column" or len(made) == 1, f"{key}: a row-parallel linear exported as {sorted(made)}"
    out = {name[: -len(".weight")]: t.reshape(-1).round().long() for name, t in made.items()}
    every = torch.sort(torch.cat(list(out.values()))).values
    assert torch.equal(every, torch.arange(n)), f"{key}: export does not place each of its {n} rows once"
    return out


def peft_tensors(model, info) -> tuple[dict, list[str]]:
    """PEFT's ``adapter_model.safetensors`` tensors of a TP-1 LoRA ``MimoModel`` and the HF module
    paths they adapt. One fused megatron LoRA is several PEFT LoRAs: a column-parallel one's B rows
    split, A shared; a row-parallel one's A columns taken in HF's order (:func:`hf_layout`)."""
    from mimo_sft.model.lora import is_lora
    from mimo_sft.model.registry import get_family

    adapter = get_family({"model_type": info.model_type}, hf_dir=info.hf_dir or "the model folder")
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []

    def put(path: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().clone().contiguous()
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach().clone().contiguous()
        modules.append(path)

    lm = model.language_model
    for layer in lm.decoder.layers if lm is not None else ():
        prefix = f"decoder.layers.{layer.layer_number - 1}."
        state = {prefix + k: v for k, v in layer.state_dict().items()
                 if isinstance(v, torch.Tensor) and not k.endswith(("_extra_state", ".lora_a", ".lora_b"))}
        for name, module in layer.named_modules():
            if not is_lora(module):
                continue
            a, b = module.lora_a.detach(), module.lora_b.detach()
            for path, index in hf_layout(adapter, info.hf_config, state, f"{prefix}{name}.weight",
                                         module.lora_kind).items():
                if module.lora_kind == "column":
                    put(path, a, b[index])
                else:
                    put(path, a[:, index], b)
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


def _holds_adapter(module) -> bool:
    return any(hasattr(m, "lora_a") for m in module.modules())


def _trains_base(module, *, every: bool = False) -> bool:
    trained = [p.requires_grad for n, p in module.named_parameters() if not n.endswith(("lora_a", "lora_b"))]
    return bool(trained) and (all(trained) if every else any(trained))


def modules_to_save(enc) -> list[str]:
    """The vision tower's (``enc``, transformers' module) trained base weights as whole modules, largest
    first: a module is saved whole when every weight in it trained, it holds no adapter and it can run on
    its own (a ``ModuleList`` cannot: PEFT wraps what it saves); a frozen part is never written. Names
    relative to ``enc`` ("" = all of it)."""
    out: list[str] = []
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)

    def visit(name: str, module) -> None:
        if not _trains_base(module):
            return
        leaf = not any(True for _ in module.children())
        if not _holds_adapter(module) and (leaf or (_trains_base(module, every=True) and not isinstance(module, containers))):
            out.append(name)
            return
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        assert not own, f"vision module {name or '<root>'} trains {own} beside adapters: no PEFT form for that"
        for child, sub in module.named_children():
            visit(f"{name}.{child}" if name else child, sub)

    visit("", enc)
    return out


def trained_vision_tensors(model) -> tuple[dict, list[str]]:
    """PEFT ``modules_to_save`` tensors (HF names) and module paths of the vision modules that trained."""
    tensors: dict[str, torch.Tensor] = {}
    paths: list[str] = []
    for enc in (model.modality_submodules[IMAGES].encoders.values() if IMAGES in model.modality_submodules else ()):
        for name in modules_to_save(enc):
            module = enc.get_submodule(name) if name else enc
            path = VISION_PATH + name if name else VISION_PATH.rstrip(".")
            paths.append(path)
            for key, value in module.state_dict().items():
                tensors[f"{PEFT_PREFIX}{path}.{key}"] = value.detach().clone().contiguous()
    return tensors, paths


def write_peft_adapter(model, info, spec: LoraSpec, src_hf_dir: str, out_dir: str) -> dict:
    """``adapter_config.json`` + ``adapter_model.safetensors`` that ``PeftModel.from_pretrained`` loads
    onto the HF model of ``src_hf_dir``: the adapters, and the vision modules that trained whole."""
    from safetensors.torch import save_file

    language = [n for n in _trained_base(model) if not n.startswith("modality_submodules.")]
    assert not language, f"LoRA keeps the language base frozen, yet {language[:3]} trained"
    tensors, modules = peft_tensors(model, info)
    saved, to_save = trained_vision_tensors(model)
    tensors.update(saved)
    if os.path.abspath(out_dir) == os.path.abspath(src_hf_dir):
        raise UserError(f"export target {out_dir} is the source folder; choose a new --out folder")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": os.path.abspath(src_hf_dir),
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
        "target_modules": target_regex(modules), "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": to_save or None, "rank_pattern": {}, "alpha_pattern": {},
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return {"out_dir": out_dir, "tensors": len(tensors), "modules": len(modules), "modules_to_save": to_save}
