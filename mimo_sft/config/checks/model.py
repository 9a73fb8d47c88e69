"""Checks 16 and 18: the model folder (config.json, weights, head and layer divisibility, the family's own
config.json rules such as Qwen3.5's layer pattern) and the note on what is left to fine-tune."""

from __future__ import annotations

import os

from mimo_sft.config import families
from mimo_sft.config.checks.context import model_type_of
from mimo_sft.parallel.layout import LANGUAGE


def c16_model(ctx):
    m = ctx.cfg.model
    if m.hf_model and not os.path.isdir(m.hf_model):
        yield f"--hf-model {m.hf_model}: folder not found; point it at a Hugging Face Qwen-VL checkpoint folder"
        return
    if m.hf_model and ctx.hf_config is None:
        yield f"--hf-model {m.hf_model}: no readable config.json in the folder"
        return
    if m.hf_model and not m.allow_random_init and not any(f.endswith(".safetensors") for f in os.listdir(m.hf_model)):
        yield (f"--hf-model {m.hf_model}: no *.safetensors weights in the folder; add them, or build the "
               f"architecture untrained with --allow-random-init")
    if ctx.hf_config is not None:
        mt = ctx.hf_config.get("model_type")
        spec = families.family_for_model_type(mt)
        if spec is None:
            yield families.unsupported_model_type(mt, f"--hf-model {m.hf_model}")
            return
        for s in ctx.specs:
            if s.name == LANGUAGE:
                yield from families.language_divisibility_findings(spec, s, ctx.hf_config)
                yield from _expert_run_findings(ctx, spec, s)
    elif ctx.for_run and not m.allow_random_init and not m.pretrained_checkpoint:
        yield "no model: give --hf-model DIR (a Hugging Face Qwen-VL folder)"
    elif not ctx.for_run:
        yield ("--hf-model not given: head/layer divisibility was not checked (finetune needs it)", "note")
    if m.allow_random_init and not m.hf_model:
        yield "--allow-random-init needs --hf-model (its config.json defines the architecture)"


def _expert_run_findings(ctx, spec, language):
    """A mixture-of-experts model's run settings: megatron's MoE layer refuses to train at tp > 1 without
    sequence parallelism; the aux-loss coefficient means nothing for a dense model."""
    m = ctx.cfg.model
    if spec.architecture.moe:
        if language.tp > 1 and not m.sequence_parallel:
            yield (f"language.tp={language.tp} with a mixture-of-experts model needs --sequence-parallel "
                   f"(megatron's MoE layer refuses tensor parallelism without it); add --sequence-parallel")
        if m.moe_aux_loss_coeff > 0 and m.recompute_granularity:
            yield (f"--moe-aux-loss-coeff={m.moe_aux_loss_coeff} with --recompute-granularity "
                   f"{m.recompute_granularity}: a recomputed layer would weigh its load-balancing loss by another "
                   f"micro-batch's tokens (train.expert_load); drop one of the two")
    elif m.moe_aux_loss_coeff > 0:
        yield (f"--moe-aux-loss-coeff={m.moe_aux_loss_coeff} has no effect: {spec.name} is a dense model "
               f"(no router)", "note")


def c18_contents_note(ctx):
    m, d = ctx.cfg.model, ctx.cfg.data
    if not ctx.for_run and (m.hf_model or d.dataset_path):
        yield ("validate checks the layout, the flags, config.json and that the paths exist and output folders are "
               "writable, opens each source as start-up does without converting it (streamed shards' footers and tar "
               "headers, a loaded parquet's footers) and stats every image and clip file its rows name; it reads no "
               "weights, decodes no image or clip and does not open JSON files or save_to_disk folders (run "
               "`mimo-sft check-data` with the same flags to decode every sample now)", "note")
