"""Checks 21 (activation recomputation), 22 (sequence parallelism) and 23 (the memory forecast fits the GPU).

Check 23's body is ``memory.check.forecast_check``, handed in as ``ctx.forecaster`` (config/ never imports
memory/, which reads config/'s schema).

Pure like the other checks: the context is ``config.checks.context.CheckContext``; the language layer count
comes from ``--hf-model``'s config.json through the family descriptor when it is there. Each finding
is an error message, or ``(message, "note")``.
"""

from __future__ import annotations

from mimo_sft.config import families
from mimo_sft.config.lora import split_targets
from mimo_sft.parallel.layout import LANGUAGE

#: megatron's selective-recompute modules that run in a dense Qwen-VL decoder on the local spec
SELECTIVE_MODULES = ("core_attn", "mlp")
#: megatron modules for other architectures (MoE, MLA): nothing of theirs is here
_OTHER_ARCHITECTURES = ("moe_act", "moe", "shared_experts", "mla_up_proj")
#: modules megatron-core 0.19.2 recomputes with ``CheckpointWithoutOutput``, which reads Transformer Engine's FP8 state
_NEEDS_TE = ("layernorm", "gdn_norm_out")


def _language(ctx):
    return next((s for s in ctx.specs if s.name == LANGUAGE), None)


def _layers_per_stage(ctx) -> tuple[int | None, int | None]:
    """``(layers of the language model, layers of each of its pipeline stages)``; None where unknown."""
    lang = _language(ctx)
    if ctx.hf_config is None or lang is None or lang.pp < 1:
        return None, None
    spec = families.family_for_model_type(ctx.hf_config.get("model_type")) or families.default_family()
    layers = spec.language_dims(ctx.hf_config).layers
    if not layers or layers % lang.pp:
        return layers, None  # check 16 refuses a pp that does not divide the layers
    return layers, layers // lang.pp


def c21_recompute(ctx):
    m = ctx.cfg.model
    if m.recompute_granularity != "full":
        for flag, value in (("--recompute-method", m.recompute_method), ("--recompute-num-layers", m.recompute_num_layers)):
            if value is not None:
                yield (f"{flag} {value} needs --recompute-granularity full (it says which whole layers to "
                       f"recompute; selective recomputation takes --recompute-modules); add "
                       f"--recompute-granularity full or drop {flag}")
    if m.recompute_granularity == "full":
        yield from _full_recompute(ctx)
    elif m.recompute_granularity == "selective":
        yield from _selective_recompute(m)
    if m.recompute_vision:
        yield from _vision_recompute(ctx)


def _full_recompute(ctx):
    m = ctx.cfg.model
    if m.recompute_method is None:
        yield ("--recompute-granularity full needs --recompute-method: 'uniform' (checkpoint groups of "
               "--recompute-num-layers layers) or 'block' (the first --recompute-num-layers layers of each stage)")
    n = m.recompute_num_layers
    if n is None:
        yield "--recompute-granularity full needs --recompute-num-layers N (layers per group, or per stage with block)"
        return
    if n < 0 or (n == 0 and m.recompute_method != "block"):
        yield f"--recompute-num-layers {n} must be >= 1"
    elif n == 0:
        yield ("--recompute-num-layers 0 with --recompute-method block recomputes no layer; give the number of "
               "layers of each stage to recompute (>= 1), or drop --recompute-granularity")
    layers, per_stage = _layers_per_stage(ctx)
    if per_stage is not None and n > per_stage:
        pp = _language(ctx).pp
        yield (f"--recompute-num-layers {n} is above the {per_stage} layers of each language pipeline stage "
               f"({layers} layers / pp {pp}); use 1-{per_stage}")


def _selective_recompute(m):
    modules = split_targets(m.recompute_modules)
    if not modules:
        yield ("--recompute-granularity selective with empty --recompute-modules recomputes nothing; "
               f"give some of {', '.join(SELECTIVE_MODULES)}")
    for name in modules:
        if name in _NEEDS_TE:
            yield (f"--recompute-modules {name} needs Transformer Engine in megatron-core 0.19.2 (its "
                   f"checkpoint without output assumes FP8 state); use {' / '.join(SELECTIVE_MODULES)}")
        elif name in _OTHER_ARCHITECTURES:
            yield (f"--recompute-modules {name}: a Qwen-VL dense decoder has no such part (MoE or MLA); use "
                   f"{' / '.join(SELECTIVE_MODULES)}")
        elif name not in SELECTIVE_MODULES:
            yield f"--recompute-modules {name}: unknown module; choose from {', '.join(SELECTIVE_MODULES)}"


def _vision_recompute(ctx):
    m = ctx.cfg.model
    if ctx.specs and all(s.name == LANGUAGE for s in ctx.specs):
        yield ("--recompute-vision without an images module does nothing", "note")
    elif m.freeze_vision and m.freeze_projector and not any(t.startswith(("vision", "merger"))
                                                            for t in split_targets(m.lora_target_modules) if m.lora_rank):
        yield ("--recompute-vision with a frozen tower and projector does nothing: the tower keeps no activations "
               "for backward", "note")


def c22_sequence_parallel(ctx):
    if not ctx.cfg.model.sequence_parallel:
        return
    lang = _language(ctx)
    if lang is None or lang.tp < 1:
        return
    if lang.tp == 1:
        yield ("--sequence-parallel with language tp=1 does nothing (it splits the positions over the TP ranks); "
               "it stays off", "note")
        return
    d = ctx.cfg.data
    if d.in_batch_packing:
        return  # each packed sequence is padded to a multiple of tp (train.packing)
    if not d.pad_to_seq_length:
        yield (f"--sequence-parallel with --no-pad-to-seq-length: rows padded to each micro-batch's longest sample "
               f"cannot be split over language tp={lang.tp}; add --in-batch-packing (packed sequences are padded "
               f"to a multiple of tp) or drop --no-pad-to-seq-length")
    elif d.seq_length % lang.tp:
        fit = -(-d.seq_length // lang.tp) * lang.tp
        yield (f"--seq-length {d.seq_length} is not a multiple of language tp={lang.tp}, which "
               f"--sequence-parallel splits every row's positions over; use --seq-length {fit}, or "
               f"--in-batch-packing (packed sequences are padded to a multiple of tp)")


def c23_memory(ctx):
    assert ctx.forecaster is not None, "check_config needs forecaster= (mimo_sft.validate passes memory.check's)"
    yield from ctx.forecaster(ctx)
