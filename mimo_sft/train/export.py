"""``mimo-sft export`` and ``finetune --export-hf``: a training checkpoint -> a Hugging Face folder.

The checkpoint's model weights are a megatron dist-checkpoint (layout-free), so export builds the
model once in this process at TP=1 with both modules on the meta device (names and shapes only),
reads its weights one decoder layer / vision block at a time (megatron reshards whatever layout the
run used) and converts each group back to Hugging Face names and layouts into shards planned as
transformers plans them (``model.export.export_weights``: host memory of about one layer plus one
shard, no GPU). A LoRA checkpoint is exported the same way, each group's base weights read from the
source folder and its adapters merged in (``model.lora_export.merged_weight_reader``);
``--adapter-only`` holds just the checkpoint's adapters and trained weights (``export_peft``).
``finetune --export-hf`` calls the same function in rank 0's process once training has ended.

Why this module sits at the top of the package, beside ``cli.py``: it joins two layers that must not
know each other -- the checkpoint format (``train.checkpoint``: finding the checkpoint, its
``meta.json``, loading its weights) and the Hugging Face writer (``model.export``) -- and model/ never
imports train/. Both the CLI and the trainer call it.
"""

from __future__ import annotations

import os

from mimo_sft.errors import UserError


def export_checkpoint(checkpoint: str, out_dir: str, *, hf_model: str | None = None, adapter_only: bool = False,
                      dtype: str | None = None, shard_size: int | str | None = None) -> str:
    """Write the checkpoint ``checkpoint`` (a folder, or its parent with ``latest``) to ``out_dir``.

    ``hf_model``: the source Hugging Face folder (config and processor files are copied from it);
    default: the one the checkpoint records. A LoRA checkpoint (meta.json ``"lora"``) is built on the
    base weights of that folder with its adapters merged (``model.lora_export``), or written as a PEFT
    adapter folder with ``adapter_only``. ``dtype`` (``fp32``/``bf16``): the weights' dtype on disk;
    default: the run's ``--dtype`` as meta.json records it. ``shard_size`` (``--export-shard-size``):
    the largest safetensors shard, as transformers' ``max_shard_size`` (default 5GB). A full
    fine-tuning checkpoint is exported streamed, one decoder layer at a time (``model.export``).
    Returns ``out_dir``.
    """
    from mimo_sft.config.checks.checkpoint import shard_size_bytes
    from mimo_sft.config.schema import CheckpointConfig

    try:  # before torch is imported: a bad flag answers at once
        max_shard = shard_size_bytes(shard_size if shard_size is not None else CheckpointConfig.export_shard_size)
    except ValueError as err:
        raise UserError(str(err)) from None
    from mimo_sft.model.export import export_weights

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file; choose a folder to write the Hugging Face checkpoint into")
    ckpt, meta, src, torch_dtype = _open(checkpoint, hf_model, dtype)
    if adapter_only and not meta.get("lora"):
        raise UserError(f"--adapter-only: {ckpt} is a full fine-tuning checkpoint (no LoRA adapters); export it without --adapter-only")
    if adapter_only:
        from mimo_sft.model.lora_export import export_peft
        from mimo_sft.train.checkpoint.save import model_weight_reader, stored_state_keys

        export_peft(model_weight_reader(ckpt), stored_state_keys(ckpt), src, out_dir, meta["lora"])
        return out_dir
    export_weights(_weight_reader(ckpt, meta, src), src, out_dir, dtype=torch_dtype, max_shard_bytes=max_shard)
    return out_dir


def checkpoint_hf_weights(checkpoint: str, *, hf_model: str | None = None, dtype: str | None = None):
    """``(base folder, torch dtype, groups)``: the weights :func:`export_checkpoint` would write for
    ``checkpoint``, as an iterator of ``{HF name: tensor}`` groups (``model.export.hf_weight_groups``),
    read one decoder layer / vision block at a time through the same readers (a LoRA checkpoint's
    adapters merged onto the base weights) and never written. ``mimo-sft generate`` loads them into
    transformers' model. Arguments as :func:`export_checkpoint`'s."""
    from mimo_sft.model.export import hf_weight_groups

    ckpt, meta, src, torch_dtype = _open(checkpoint, hf_model, dtype)
    return src, torch_dtype, hf_weight_groups(_weight_reader(ckpt, meta, src), src, dtype=torch_dtype)


def _open(checkpoint: str, hf_model: str | None, dtype: str | None):
    """``(checkpoint folder, its meta.json, the base HF folder, the torch dtype to convert to)``, each
    refused in one line when it cannot be used. Reads no tensor."""
    from mimo_sft.model.export import EXPORT_DTYPES
    from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    meta = read_meta(ckpt)
    src = hf_model or meta.get("hf_model")
    if not src:
        raise UserError(f"--checkpoint {ckpt} does not record its source model; pass --hf-model DIR")
    if not os.path.isdir(src):
        raise UserError(f"--hf-model {src}: folder not found (its config and processor files are read, and a "
                        f"LoRA checkpoint's base weights); pass --hf-model DIR")
    dtype = dtype or meta.get("dtype", "fp32")
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    return ckpt, meta, src, EXPORT_DTYPES[dtype][0]


def _weight_reader(ckpt: str, meta: dict, src: str):
    """``read(model, keys)`` of the checkpoint's weights (checked by ``train.checkpoint.trusted`` before
    anything is read); a LoRA checkpoint's merged onto the base weights of ``src``."""
    from mimo_sft.train.checkpoint.save import model_weight_reader, stored_state_keys

    read = model_weight_reader(ckpt)
    if meta.get("lora"):
        from mimo_sft.model.lora_export import merged_weight_reader

        read = merged_weight_reader(read, stored_state_keys(ckpt), src, meta["lora"])
    return read
