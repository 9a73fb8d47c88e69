"""Export: a single-process TP=1 ``MimoModel`` state -> a Hugging Face checkpoint folder.

The output holds the source folder's config.json and every non-weight file (tokenizer, chat
template, processor configs) copied as they are, and safetensors written with the source's tensor
names (``visual.*`` / ``model.layers.*`` or ``model.visual.*`` / ``model.language_model.*``), so
``AutoModelForImageTextToText.from_pretrained(out_dir)`` loads it and HF -> mimo -> HF is bit-exact.

:func:`export_weights` is the model side of exporting a training checkpoint: it builds the 1-rank
model in host memory without initialisation, lets the caller load the weights into it, and writes
the folder. Reading the checkpoint is ``train.checkpoint``'s business; ``mimo_sft.export`` joins the
two (model/ never imports train/).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

import torch

from mimo_sft.errors import UserError
from mimo_sft.model.registry import get_family
from mimo_sft.parallel.layout import IMAGES
from mimo_sft.model.hf_checkpoint import SAFE_INDEX, SAFE_SINGLE, HFCheckpoint, read_config_json

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = (SAFE_INDEX, "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 4 * 1024 ** 3
#: the training dtypes (``--dtype``) as torch dtypes and as config.json spells them
EXPORT_DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}


def split_mimo_state(sd: dict) -> tuple[dict, dict]:
    """A MimoModel state dict -> (language ``GPTModel`` state, vision encoder state), prefixes removed.

    Tolerates a ``module.`` level (DDP / Float16Module) and skips ``_extra_state`` entries.
    """
    language, encoder = {}, {}
    for key, value in sd.items():
        if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        k = key.replace(".module.", ".")
        if k.startswith("module."):
            k = k[len("module."):]
        if k.startswith("language_model."):
            language[k[len("language_model."):]] = value
        elif k.startswith(f"modality_submodules.{IMAGES}.encoders."):
            rest = k[len(f"modality_submodules.{IMAGES}.encoders."):]
            encoder[rest.split(".", 1)[1]] = value
    return language, encoder


def _shards(tensors: dict, max_bytes: int) -> list[dict]:
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += n
    if cur or not shards:
        shards.append(cur)
    return shards


def write_safetensors(tensors: dict, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` as ``model.safetensors`` or as shards plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file({k: v.detach().clone().contiguous() for k, v in shards[0].items()},
                  os.path.join(out_dir, SAFE_SINGLE), metadata={"format": "pt"})
        return [SAFE_SINGLE]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().clone().contiguous() for k, v in shard.items()}, os.path.join(out_dir, fname),
                  metadata={"format": "pt"})
        names.append(fname)
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    with open(os.path.join(out_dir, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return names + [SAFE_INDEX]


def _copy_side_files(src: str, out: str) -> list[str]:
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES:
            continue
        shutil.copy2(path, os.path.join(out, name))
        copied.append(name)
    return copied


def _source_prefix_style(src_hf_dir: str) -> str:
    try:
        return HFCheckpoint(src_hf_dir).prefix_style
    except UserError:  # random-init source without weights: write transformers' on-disk layout
        return "legacy"


def export_hf(megatron_state_dict_tp1: dict, src_hf_dir: str, out_dir: str, *, dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Write ``out_dir`` as a Hugging Face checkpoint from a TP=1 MimoModel state; returns a summary.

    ``megatron_state_dict_tp1``: keys as in a single-process TP=1 ``MimoModel.state_dict()``
    (``language_model.*`` and ``modality_submodules.images.encoders.<name>.*``). ``dtype`` casts
    the weights (default: as they are).
    """
    raw = read_config_json(src_hf_dir)
    adapter = get_family(raw, hf_dir=src_hf_dir)
    hf_cfg = adapter.load_hf_config(src_hf_dir, raw)
    language, encoder = split_mimo_state(megatron_state_dict_tp1)
    if not language or not encoder:
        raise UserError(f"export needs both the language model and the vision encoder in one TP=1 state; got "
                        f"{len(language)} language and {len(encoder)} encoder tensors (build with build_single_process_model)")
    tensors = adapter.export(language, encoder, hf_cfg, prefix_style=_source_prefix_style(src_hf_dir))
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if os.path.abspath(out_dir) == os.path.abspath(src_hf_dir):
        raise UserError(f"export target {out_dir} is the source folder; choose a new --out folder")
    os.makedirs(out_dir, exist_ok=True)
    copied = _copy_side_files(src_hf_dir, out_dir)
    if dtype is not None:
        _set_config_dtype(os.path.join(out_dir, "config.json"), dtype)
    files = write_safetensors(tensors, out_dir, max_shard_bytes)
    return {"out_dir": out_dir, "tensors": len(tensors), "weight_files": files, "copied": copied}


def _set_config_dtype(config_path: str, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights are written in (``dtype``, and ``torch_dtype`` --
    the older transformers key -- wherever the source had one), so ``from_pretrained(dtype="auto")``
    loads them as written."""
    name = str(dtype).removeprefix("torch.")
    with open(config_path) as fh:
        cfg = json.load(fh)

    def walk(node):
        if isinstance(node, dict):
            for key in ("torch_dtype", "dtype"):
                if key in node:
                    node[key] = name
            for value in node.values():
                walk(value)

    walk(cfg)
    cfg["dtype"] = name
    with open(config_path, "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)


def export_model(model, src_hf_dir: str, out_dir: str, **kw) -> dict:
    """``export_hf(model.state_dict(), ...)`` for a model built by ``build_single_process_model``."""
    return export_hf(model.state_dict(), src_hf_dir, out_dir, **kw)


def export_weights(load_weights: Callable[[torch.nn.Module], None], src_hf_dir: str, out_dir: str, *,
                   dtype: Optional[torch.dtype] = None) -> dict:
    """Build the 1-rank TP=1 model of ``src_hf_dir``, fill it with ``load_weights(model)``, write ``out_dir``
    (in ``dtype``: the run's training dtype, so a bf16 run's weights are written as trained, not upcast).

    The model is built in host memory with megatron's initialisation off (``load_weights`` supplies
    every weight), so export never uses a GPU, never competes with training memory on a GPU node,
    and holds one copy of the model.
    """
    from mimo_sft.model.builder import build_single_process_model

    model, _info = build_single_process_model(src_hf_dir, random_init=True, prefer="cpu", cpu_init=True,
                                              config_overrides={"perform_initialization": False})
    load_weights(model)
    return export_model(model, src_hf_dir, out_dir, dtype=dtype)
