"""Checks 20 and 29: LoRA flags (and a starting checkpoint's LoRA settings they must agree with), per-module
learning rates, weight decay and experiment trackers."""

from __future__ import annotations


def c20_lora(ctx):
    from mimo_sft.config.lora import lora_problems

    problems = lora_problems(ctx.cfg.model)
    yield from problems
    from mimo_sft.config.checks.context import family_spec
    from mimo_sft.config.lora import recorded_lora_problems, split_targets
    from mimo_sft.config.recorded import starting_checkpoint, starting_meta

    m = ctx.cfg.model
    start = starting_checkpoint(ctx.cfg)
    meta = starting_meta(ctx.cfg) if start and not problems else None
    if meta is not None:  # an explicit LoRA flag that the checkpoint's adapters cannot load with
        yield from recorded_lora_problems(meta.get("lora"), m, path=start[0], resume=start[1])
    if m.lora_rank > 0 and family_spec(ctx).architecture.moe and set(split_targets(m.lora_target_modules)) & {
            "linear_fc1", "linear_fc2"}:
        yield ("--lora-target-modules linear_fc1/linear_fc2 on a mixture-of-experts model adapt the dense layers' "
               "MLP only: the experts and routers of its sparse layers stay frozen under LoRA", "note")
    if ctx.cfg.model.lora_rank > 0 and ctx.cfg.optimizer.use_distributed_optimizer:
        yield ("--lora-rank: the adapters train with the plain (unsharded) optimizer, not the distributed one "
               "(mimo-sft's choice: adapter optimizer state is small)", "note")


def c29_learning_rates_and_trackers(ctx):
    from mimo_sft.config.lora import PROJECTOR_TARGETS, VISION_TARGETS, split_targets

    o, m, lg = ctx.cfg.optimizer, ctx.cfg.model, ctx.cfg.logging
    targets = set(split_targets(m.lora_target_modules)) if m.lora_rank > 0 else set()
    for flag, value, frozen, part, unfreeze in (
            ("--vision-lr", o.vision_lr, m.freeze_vision and not targets & set(VISION_TARGETS), "vision tower",
             "drop --freeze-vision (or add LoRA targets vision_attn/vision_mlp)"),
            ("--projector-lr", o.projector_lr, m.freeze_projector and not targets & set(PROJECTOR_TARGETS),
             "patch merger (projector)", "drop --freeze-projector (or add the LoRA target merger)")):
        if value is None:
            continue
        if value < 0:
            yield f"{flag}={value} must be >= 0"
        elif frozen:
            yield f"{flag} is set but the {part} does not train: remove {flag}, or {unfreeze}"
    if o.weight_decay < 0:
        yield f"--weight-decay={o.weight_decay} must be >= 0"
    for flag, value in (("--wandb-exp-name", lg.wandb_exp_name), ("--wandb-save-dir", lg.wandb_save_dir)):
        if value and not lg.wandb_project:
            yield f"{flag} without --wandb-project: add --wandb-project NAME to log to Weights & Biases"
    from mimo_sft.config.trackers import missing_tracker_packages

    for flag, install in missing_tracker_packages(lg):
        yield f"{flag} needs the {install} package, which is not installed: pip install {install} (or: pip install 'mimo-sft[tracking]')"
