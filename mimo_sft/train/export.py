"""``mimo-sft export``: a training checkpoint -> a Hugging Face folder transformers loads.

The checkpoint's model weights are a megatron dist-checkpoint (layout-free), so export builds the
model once in this process at TP=1 with both modules (``build_single_process_model``), loads the
weights into it (megatron reshards whatever layout the run used) and converts them back to
Hugging Face names and layouts. The model is built in host memory without initialisation (the
checkpoint supplies every weight): export never uses a GPU and holds one copy of the model.
``finetune --export-hf`` calls the same function in rank 0's process once training has ended.
"""

from __future__ import annotations

import os

from mimo_sft.errors import UserError


def export_checkpoint(checkpoint: str, out_dir: str, *, hf_model: str | None = None) -> str:
    from mimo_sft.model import build_single_process_model, export_model
    from mimo_sft.train.checkpoint import load_model_weights, read_meta, resolve_checkpoint

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file; choose a folder to write the Hugging Face checkpoint into")
    ckpt = resolve_checkpoint(checkpoint)
    meta = read_meta(ckpt)
    src = hf_model or meta.get("hf_model")
    if not src:
        raise UserError(f"--checkpoint {ckpt} does not record its source model; pass --hf-model DIR")
    if not os.path.isdir(src):
        raise UserError(f"--hf-model {src}: folder not found (export copies its config and processor files)")
    model, _info = build_single_process_model(src, random_init=True, prefer="cpu", cpu_init=True,
                                              config_overrides={"perform_initialization": False})
    load_model_weights(model, ckpt)
    export_model(model, src, out_dir)
    return out_dir
