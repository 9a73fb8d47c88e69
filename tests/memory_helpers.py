"""Workers for the memory tests: build a layout's real model, DDP and optimizer, and report what each
rank holds (parameters, trainable parameters, DDP grad-buffer values, optimizer fp32 main weights)."""

from __future__ import annotations


def _main_param_numel(optimizer) -> int:
    """fp32 main weights an optimizer (plain bf16 or distributed) holds on this rank."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    n = 0
    for opt in inner:
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            groups = getattr(opt, attr, None)
            if groups:
                n += sum(p.numel() for g in groups for p in g)
                break
    return n


def worker_rank_state(rank: int, world: int, flags: list) -> dict:
    """For each module on this rank: held / trainable parameter counts, grad-buffer numel (unpadded)
    and dtype, optimizer main-weight numel, and this rank's language pp stage."""
    from mimo_sft.validate import require_valid
    from mimo_sft.config.loader import load_config
    from mimo_sft.parallel.layout import LANGUAGE
    from mimo_sft.train.setup import build_model_and_optimizer, build_state

    cfg = load_config(flags)
    layout = require_valid(cfg, world_size=world).layout
    pstate = build_state(cfg, layout)
    ctx = build_model_and_optimizer(cfg, layout, pstate, rank)
    out = {}
    for name, ddp in ctx.modules.items():
        params = list(ddp.module.parameters())
        infos = ctx.optimizer.module_infos
        opt = infos[name].optimizer if name in infos else None
        out[name] = {
            "held": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "trainable_tensors": sum(1 for p in params if p.requires_grad),
            "grad_numel": sum(b.numel_unpadded for b in ddp.buffers),
            "grad_dtypes": sorted({str(b.grad_dtype) for b in ddp.buffers}),
            "main_numel": _main_param_numel(opt) if opt is not None else 0,
            "stage": layout.coords(rank)[name].pp if name == LANGUAGE else 0,
        }
    return out
