"""Export: a single-process TP=1 ``MimoModel`` state -> a Hugging Face checkpoint folder.

The output holds the source folder's config.json (its dtype set to the written one) and every
non-weight file (tokenizer, chat template, processor configs) copied as they are, and safetensors
written with the source's tensor names (``visual.*`` / ``model.layers.*`` or ``model.visual.*`` /
``model.language_model.*``) in shards planned as transformers' ``save_pretrained`` plans them, with
its ``model.safetensors.index.json`` (``model.export_shards``), so
``AutoModelForImageTextToText.from_pretrained(out_dir)`` loads it and HF -> mimo -> HF is bit-exact.

:func:`export_weights` is the model side of exporting a training checkpoint, streamed: it builds the
1-rank model on the meta device (shapes and checkpoint keys, no memory), plans the shards from the
converted shapes, then asks the caller for one group of weights at a time (a decoder layer, a vision
block, an embedding), converts and casts it, and hands it to the shard writer, which writes each
shard once complete. Host memory: about one group plus one shard, never the model. Reading the
checkpoint is ``train.checkpoint``'s business; ``mimo_sft.train.export`` joins the two (model/ never imports
train/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Iterator, Optional

import torch

from mimo_sft.errors import UserError
from mimo_sft.model.registry import get_family
from mimo_sft.parallel.layout import IMAGES
from mimo_sft.model.export_shards import (DEFAULT_SHARD_SIZE, ShardWriter, order_like_transformers, plan_shards,
                                         shard_size_bytes)
from mimo_sft.model.hf_checkpoint import SAFE_INDEX, HFCheckpoint, group_by_block, read_config_json

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = (SAFE_INDEX, "pytorch_model.bin.index.json")
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


def _source_family(src_hf_dir: str):
    """``(adapter, hf_cfg, prefix_style)`` of ``src_hf_dir``: the family adapter, its transformers config
    and the tensor naming its files use (what an export writes)."""
    raw = read_config_json(src_hf_dir)
    adapter = get_family(raw, hf_dir=src_hf_dir)
    return adapter, adapter.load_hf_config(src_hf_dir, raw), _source_prefix_style(src_hf_dir)


def _prepare_out_dir(src_hf_dir: str, out_dir: str, dtype: Optional[torch.dtype]):
    """The family adapter and config of ``src_hf_dir``; ``out_dir`` made with the side files copied
    and config.json's dtype set. Returns ``(adapter, hf_cfg, prefix_style, copied)``."""
    adapter, hf_cfg, style = _source_family(src_hf_dir)
    if os.path.abspath(out_dir) == os.path.abspath(src_hf_dir):
        raise UserError(f"export target {out_dir} is the source folder; choose a new --out folder")
    os.makedirs(out_dir, exist_ok=True)
    copied = _copy_side_files(src_hf_dir, out_dir)
    if dtype is not None:
        _set_config_dtype(os.path.join(out_dir, "config.json"), dtype)
    return adapter, hf_cfg, style, copied


def _to_hf(adapter, hf_cfg, prefix_style: str, mimo_part: dict, dtype: Optional[torch.dtype]) -> dict:
    """A part of a TP=1 MimoModel state (the whole, or one group) -> HF tensors in ``dtype``."""
    language, encoder = split_mimo_state(mimo_part)
    tensors = adapter.export(language, encoder, hf_cfg, prefix_style=prefix_style)
    return {k: _own_storage(v.to(dtype) if dtype is not None else v) for k, v in tensors.items()}


def _passthrough_groups(adapter, src_hf_dir: str) -> tuple[Optional[HFCheckpoint], list[list[str]]]:
    """The source folder's tensors that the model does not hold but an export keeps
    (``adapter.passthrough``: Qwen3.5's ``mtp.*``), grouped by block; none without source weights."""
    try:
        source = HFCheckpoint(src_hf_dir)
    except UserError:  # a random-init source without weights
        return None, []
    return source, group_by_block(n for n in source.keys() if adapter.passthrough(n))


def _cast_meta(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _read_cast(source: HFCheckpoint, names: list, dtype: Optional[torch.dtype]) -> dict:
    return {n: _own_storage(_cast_meta(source.read(n), dtype)) for n in names}


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view into a larger storage (gate/up of one fused fc1, q/k/v of one
    qkv): safetensors refuses tensors that share memory, and a view keeps its whole source alive."""
    if t.is_meta or t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _as_meta(tensors: dict) -> dict:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}


def _start_writer(out_dir: str, hf_cfg, meta_tensors: dict, max_shard_bytes: int) -> ShardWriter:
    """transformers' shard plan for ``meta_tensors`` (put in its save order); stale weight files of an
    earlier export into ``out_dir`` removed."""
    ordered = {n: meta_tensors[n] for n in order_like_transformers(meta_tensors, hf_cfg)}
    plan = plan_shards(ordered, max_shard_bytes)
    _remove_stale_weights(out_dir, keep=set(plan.filename_to_tensors))
    return ShardWriter(out_dir, plan, ordered)


def _remove_stale_weights(out_dir: str, keep: set) -> None:
    shard = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
    for name in os.listdir(out_dir):
        if (shard.fullmatch(name) and name not in keep) or name == SAFE_INDEX:
            os.remove(os.path.join(out_dir, name))


def export_hf(megatron_state_dict_tp1: dict, src_hf_dir: str, out_dir: str, *, dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int | str = DEFAULT_SHARD_SIZE) -> dict:
    """Write ``out_dir`` as a Hugging Face checkpoint from a whole TP=1 MimoModel state; returns a summary.

    ``megatron_state_dict_tp1``: keys as in a single-process TP=1 ``MimoModel.state_dict()``
    (``language_model.*`` and ``modality_submodules.images.encoders.<name>.*``). ``dtype`` casts
    the weights (default: as they are). The merged LoRA export and tests use it; a training
    checkpoint is exported streamed (:func:`export_weights`), into the same files.
    """
    language, encoder = split_mimo_state(megatron_state_dict_tp1)
    if not language or not encoder:
        raise UserError(f"export needs both the language model and the vision encoder in one TP=1 state; got "
                        f"{len(language)} language and {len(encoder)} encoder tensors (build with build_single_process_model)")
    limit = shard_size_bytes(max_shard_bytes)
    adapter, hf_cfg, style, copied = _prepare_out_dir(src_hf_dir, out_dir, dtype)
    tensors = _to_hf(adapter, hf_cfg, style, megatron_state_dict_tp1, dtype)
    source, kept = _passthrough_groups(adapter, src_hf_dir)
    for group in kept:
        tensors.update(_read_cast(source, group, dtype))
    writer = _start_writer(out_dir, hf_cfg, _as_meta(tensors), limit)
    writer.add({k: v.detach() for k, v in tensors.items()})
    return {"out_dir": out_dir, "tensors": len(tensors), "weight_files": writer.finish(), "copied": copied}


def _set_config_dtype(config_path: str, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights are written in, so ``from_pretrained(dtype="auto")``
    loads them as written (:func:`config_with_dtype`)."""
    with open(config_path) as fh:
        cfg = json.load(fh)
    with open(config_path, "w") as fh:
        json.dump(config_with_dtype(cfg, dtype), fh, indent=2, sort_keys=True)


def config_with_dtype(cfg: dict, dtype: torch.dtype) -> dict:
    """A config.json dict as an export writes it: ``dtype``, and ``torch_dtype`` -- the older
    transformers key -- wherever the source had one, naming ``dtype`` (changed in place, returned)."""
    name = str(dtype).removeprefix("torch.")

    def walk(node):
        if isinstance(node, dict):
            for key in ("torch_dtype", "dtype"):
                if key in node:
                    node[key] = name
            for value in node.values():
                walk(value)

    walk(cfg)
    cfg["dtype"] = name
    return cfg


def export_model(model, src_hf_dir: str, out_dir: str, **kw) -> dict:
    """``export_hf(model.state_dict(), ...)`` for a model built by ``build_single_process_model``."""
    return export_hf(model.state_dict(), src_hf_dir, out_dir, **kw)


def meta_model(src_hf_dir: str):
    """The 1-rank TP=1 model of ``src_hf_dir`` on the meta device and its ``ModelInfo``: its state names
    and shapes, and its ``sharded_state_dict`` (the checkpoint's keys), for no memory."""
    from mimo_sft.model.builder import build_mimo_model
    from mimo_sft.parallel.bootstrap import start_single_process

    state = start_single_process("cpu")  # megatron's process state is made outside the meta context
    with torch.device("meta"):
        return build_mimo_model(src_hf_dir, layout=state.layout, parallel_state=state, random_init=True,
                                cpu_init=True, config_overrides={"perform_initialization": False})


def export_weights(read_weights: Callable[[torch.nn.Module, list], dict], src_hf_dir: str, out_dir: str, *,
                   dtype: Optional[torch.dtype] = None, max_shard_bytes: int | str = DEFAULT_SHARD_SIZE) -> dict:
    """Write ``out_dir`` from a training checkpoint, streamed group by group (see the module doc).

    ``read_weights(model, keys)`` returns ``{key: tensor}`` for those ``state_dict`` keys of ``model``
    (the meta-device 1-rank model whose ``sharded_state_dict`` names the checkpoint's tensors), in
    host memory. ``dtype``: the written dtype (the run's training dtype, so a bf16 run's weights are
    written as trained, not upcast). ``max_shard_bytes``: ``--export-shard-size``.
    """
    limit = shard_size_bytes(max_shard_bytes)
    adapter, hf_cfg, style, copied = _prepare_out_dir(src_hf_dir, out_dir, dtype)
    model, _info = meta_model(src_hf_dir)
    planned = _planned_groups(adapter, hf_cfg, style, model, dtype)
    source, kept = _passthrough_groups(adapter, src_hf_dir)
    planned += [(None, {n: _cast_meta(source.meta(n), dtype) for n in group}) for group in kept]
    writer = _start_writer(out_dir, hf_cfg, {n: t for _, hf in planned for n, t in hf.items()}, limit)
    position = {name: i for i, name in enumerate(writer.meta)}
    for keys, hf in sorted(planned, key=lambda kh: min(position[n] for n in kh[1])):
        if keys is None:  # a source tensor kept as it is (the adapter's passthrough)
            writer.add(_read_cast(source, list(hf), dtype))
            source.close()
            continue
        part = read_weights(model, keys)
        writer.add(_to_hf(adapter, hf_cfg, style, part, dtype))
        del part
    files = writer.finish()
    return {"out_dir": out_dir, "tensors": len(writer.meta), "weight_files": files, "copied": copied}


def _planned_groups(adapter, hf_cfg, style: str, model, dtype: Optional[torch.dtype]) -> list[tuple[list, dict]]:
    """``(state keys, their HF tensors on the meta device)`` of each group of ``model`` (the meta 1-rank
    model) that becomes HF tensors, in the model's order: what :func:`export_weights` plans its shards
    from and :func:`hf_weight_groups` reads, without reading a weight."""
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    planned = [(keys, _to_hf(adapter, hf_cfg, style, {k: state[k] for k in keys}, dtype)) for keys in group_by_block(state)]
    return [(keys, hf) for keys, hf in planned if hf]


def hf_weight_groups(read_weights: Callable[[torch.nn.Module, list], dict], src_hf_dir: str, *,
                     dtype: Optional[torch.dtype] = None) -> Iterator[dict]:
    """The tensors :func:`export_weights` would write, one group (a decoder layer, a vision block, an
    embedding) at a time, without writing them: names as the source folder's files spell them, in
    ``dtype``. ``mimo-sft generate`` loads them into transformers' model in memory. The source's
    passthrough tensors (Qwen3.5's ``mtp.*``, which transformers' model does not hold) are left out.
    Host memory: the group being converted, beside whatever the caller keeps."""
    adapter, hf_cfg, style = _source_family(src_hf_dir)
    model, _info = meta_model(src_hf_dir)
    for keys, _meta in _planned_groups(adapter, hf_cfg, style, model, dtype):
        part = read_weights(model, keys)
        yield _to_hf(adapter, hf_cfg, style, part, dtype)
        del part
