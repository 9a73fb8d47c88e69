"""Checks 1-12: the layout itself -- sizes, modules, rank ranges that tile the world, TP/DP arithmetic,
the micro-batch on the canonical grid, and each module's partition against its family's limits."""

from __future__ import annotations

from mimo_sft.config import families
from mimo_sft.config.checks.context import family_spec, is_pow2, model_type_of, rank_ranges
from mimo_sft.parallel.layout import LANGUAGE


def c01_positive_sizes(ctx):
    for s in ctx.specs:
        for key in ("tp", "pp", "cp", "dp", "ep", "etp"):
            if getattr(s, key) is not None and getattr(s, key) < 1:
                yield f"{s.name}.{key}={getattr(s, key)} must be >= 1"
        if s.rank_offset < 0:
            yield f"{s.name}.rank_offset={s.rank_offset} must be >= 0"
    t, d = ctx.cfg.train, ctx.cfg.data
    for name, val in (("--micro-batch-size", t.micro_batch_size), ("--global-batch-size", t.global_batch_size),
                      ("--train-iters", t.train_iters), ("--seq-length", d.seq_length),
                      ("--log-interval", ctx.cfg.logging.log_interval)):
        if val < 1:
            yield f"{name}={val} must be >= 1"
    if t.dist_timeout_s < 1:
        yield f"--dist-timeout={t.dist_timeout_s} must be >= 1 (seconds)"
    hang = t.hang_timeout_s
    if hang is not None and hang < 0:
        yield f"--hang-timeout={hang} must be >= 1 seconds (or 0: no watchdog)"
    elif hang and hang > t.dist_timeout_s - 30:
        yield (f"--hang-timeout {hang} is not shorter than --dist-timeout {t.dist_timeout_s} by 30 s: the collective "
               f"would time out first and the watchdog could not say which rank hung; lower --hang-timeout or raise "
               f"--dist-timeout")
    if not ctx.cfg.logging.straggler_threshold > 1:
        yield (f"--straggler-threshold={ctx.cfg.logging.straggler_threshold} must be > 1 (a multiple of the median "
               f"work per step of a rank's peers, e.g. 1.5)")
    if t.exit_interval is not None and t.exit_interval < 1:
        yield f"--exit-interval={t.exit_interval} must be >= 1"
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        yield f"--exit-duration-in-mins={t.exit_duration_in_mins} must be > 0"
    si = ctx.cfg.checkpoint.save_interval
    if si is not None and si < 1:
        yield f"--save-interval={si} must be >= 1"
    keep = ctx.cfg.checkpoint.keep_last_checkpoints
    if keep is not None and keep < 1:
        yield f"--keep-last-checkpoints={keep} must be >= 1 (leave it out to keep every checkpoint)"
    if ctx.cfg.logging.peak_tflops is not None and ctx.cfg.logging.peak_tflops <= 0:
        yield f"--peak-tflops={ctx.cfg.logging.peak_tflops} must be > 0 (a GPU's dense bf16 peak, e.g. 989 for an H100 SXM)"
    if ctx.cfg.model.moe_aux_loss_coeff < 0:
        yield f"--moe-aux-loss-coeff={ctx.cfg.model.moe_aux_loss_coeff} must be >= 0 (0: no load-balancing loss)"
    o = ctx.cfg.optimizer
    for name, val in (("--lr", o.lr), ("--min-lr", o.min_lr)):
        if val < 0:
            yield f"{name}={val} must be >= 0"
    if o.lr >= 0 and o.min_lr >= 0 and o.min_lr > o.lr:
        yield f"--min-lr={o.min_lr} is above --lr={o.lr}; lower --min-lr"
    if o.lr_warmup_iters < 0:
        yield f"--lr-warmup-iters={o.lr_warmup_iters} must be >= 0"
    if o.lr_decay_iters is not None and o.lr_decay_iters < 1:
        yield f"--lr-decay-iters={o.lr_decay_iters} must be >= 1 (the steps of warm-up and decay)"
    if ctx.cfg.parallel.world_size is not None and ctx.cfg.parallel.world_size < 1:
        yield f"--world-size={ctx.cfg.parallel.world_size} must be >= 1"


def c02_components_present(ctx):
    if not ctx.specs:
        yield "no modules given; add --component 'language=tp=1,dp=N,rank_offset=0' and one per encoder (e.g. images)"


def c03_language_present(ctx):
    if ctx.specs and LANGUAGE not in {s.name for s in ctx.specs}:
        yield "no 'language' module; add --component 'language=tp=...,dp=...,rank_offset=...'"


def c04_module_names(ctx):
    family = model_type_of(ctx)
    spec = family_spec(ctx)  # an unsupported model_type is check 16's line, not a modality problem
    allowed = spec.modalities
    for s in ctx.specs:
        if s.name != LANGUAGE and s.name not in allowed:
            yield (f"module '{s.name}' is not a modality of {family or 'Qwen-VL'} models; "
                   f"use one of: {', '.join((LANGUAGE,) + allowed)}")


def c05_rank_ranges(ctx):
    specs = [s for s in ctx.specs if s.size > 0 and s.rank_offset >= 0]
    if not specs or ctx.layout is None:
        return
    world = ctx.world_size
    if ctx.layout.colocated:
        covered = set(specs[0].ranks)
    else:
        owner: dict[int, str] = {}
        for s in specs:
            for r in s.ranks:
                if r in owner:
                    yield (f"modules '{owner[r]}' and '{s.name}' overlap at rank {r}; give disjoint "
                           f"rank_offset ranges, or identical ranges for a colocated layout")
                    return
                owner[r] = s.name
        covered = set(owner)
    implied = max(r for r in covered) + 1
    gaps = sorted(set(range(implied)) - covered)
    if gaps:
        yield f"ranks {rank_ranges(gaps)} belong to no module; shift rank_offset so the modules tile 0..{implied - 1}"
    if world is not None and world != implied:
        yield (f"world size {world} does not match the {implied} ranks the modules use; "
               f"change --world-size or the components' dp/tp/pp/rank_offset")


def c06_tp_power_of_two(ctx):
    for s in ctx.specs:
        if s.tp >= 1 and not is_pow2(s.tp):
            yield f"{s.name}.tp={s.tp} is not a power of two; use 1, 2, 4, 8 (mimo-sft's own limit)"
        if s.etp is not None and s.etp >= 1 and not is_pow2(s.etp):
            yield f"{s.name}.etp={s.etp} is not a power of two; use 1, 2, 4, 8 (mimo-sft's own limit)"


def c07_dp_divisibility(ctx):
    dps = sorted({s.dp for s in ctx.specs if s.dp >= 1})
    for a in dps:
        for b in dps:
            if a < b and b % a:
                yield (f"module DP sizes {a} and {b} do not divide one another; megatron's bridge "
                       f"needs an integer fan-in/fan-out ratio: make one DP size a multiple of the other")
                return


def c08_micro_batch(ctx):
    if ctx.layout is None or ctx.cfg.train.micro_batch_size < 1:
        return
    mbs = ctx.cfg.train.micro_batch_size
    g = ctx.layout.canonical_grid
    if mbs % g:
        yield (f"--micro-batch-size={mbs} is not divisible by the canonical grid {g} (LCM of module DP "
               f"sizes); use a multiple of {g}")
    for s in ctx.specs:
        if s.dp >= 1 and mbs % s.dp and g % s.dp == 0 and mbs % g == 0:
            yield f"--micro-batch-size={mbs} is not divisible by {s.name}.dp={s.dp}"


def c09_global_batch(ctx):
    t = ctx.cfg.train
    if t.micro_batch_size >= 1 and t.global_batch_size >= 1 and t.global_batch_size % t.micro_batch_size:
        yield (f"--global-batch-size={t.global_batch_size} is not a multiple of --micro-batch-size="
               f"{t.micro_batch_size}; each step runs whole micro-batches")


def c10_encoder_limits(ctx):
    if ctx.layout is None:
        return
    lang = next((s for s in ctx.specs if s.name == LANGUAGE), None)
    spec = family_spec(ctx)
    for s in ctx.specs:
        if s.name == LANGUAGE:
            continue
        yield from families.encoder_findings(spec, s, colocated=ctx.layout.colocated,
                                             language_dp=lang.dp if lang else None)
        if lang and not ctx.layout.colocated and s.dp > lang.dp:
            yield (f"{s.name}.dp={s.dp} > language.dp={lang.dp}: megatron's bridge fan-in asserts when "
                   f"image-token counts vary per sample; make {s.name}.dp <= language.dp")


def c11_colocated(ctx):
    if ctx.layout is None:
        return
    if ctx.cfg.reorder.encoder_balance:  # train.encoder_balance: one vision DP group that is every GPU's slice
        dps = {s.dp for s in ctx.specs}
        if not ctx.layout.colocated:
            yield ("--encoder-balance needs a colocated layout (its towers share the GPUs of the language model); "
                   "on separate encoder ranks use --intra-microbatch-reorder, which balances them already")
        elif len(dps) > 1:
            yield (f"--encoder-balance on a colocated layout needs equal DP sizes (got {sorted(dps)}: mimo-sft's own "
                   f"limit, the bridge's gather groups read fixed encoder slices); make the DP sizes equal or drop it")
    if not ctx.layout.colocated:
        return
    for s in ctx.specs:
        if s.pp > 1:
            yield (f"colocated layout with {s.name}.pp={s.pp}: megatron's ColocatedBridgeCommunicator needs pp=1; "
                   f"set pp=1 or give the modules disjoint ranks")
        # language cp crosses the bridge folded into tp (model.context_parallel); encoder cp is check 10's
    r = ctx.cfg.reorder
    if not r.enabled:
        return
    # colocated balancing (data.reorder.colocated_plan) places samples on the canonical grid of two DP
    # sizes that divide one another, and reads them by index
    if r.mode != "index":
        yield (f"--reorder-mode {r.mode} with --intra-microbatch-reorder on a colocated layout is not supported "
               "(mimo-sft's own limit: colocated balancing reads each rank's samples by index); use --reorder-mode index")
    dps = sorted({s.dp for s in ctx.specs if s.dp >= 1})
    if len(dps) == 2 and dps[1] % dps[0]:
        yield (f"--intra-microbatch-reorder on a colocated layout needs DP sizes that divide one another "
               f"(got {dps[0]} and {dps[1]}): the balanced micro-batch is laid out on the canonical grid both "
               f"modules read; make one DP size a multiple of the other or drop the flag")


def c12_language_partition(ctx):
    lang = next((s for s in ctx.specs if s.name == LANGUAGE), None)
    if lang:
        yield from families.language_partition_findings(family_spec(ctx), lang)
    if lang and lang.ep >= 1 and lang.expert_tp >= 1 and not lang.expert_dp:
        yield (f"language.ep={lang.ep} x etp={lang.expert_tp} does not divide the {lang.tp * lang.cp * lang.dp} ranks "
               f"of a language pipeline stage (tp*cp*dp = {lang.tp}*{lang.cp}*{lang.dp}); choose ep and etp whose "
               f"product divides it")
    for s in ctx.specs:
        if s.name != LANGUAGE and (s.ep > 1 or (s.etp or 1) > 1):
            given = f"{s.name}.ep={s.ep}" + (f", etp={s.etp}" if s.etp is not None else "")
            yield (f"{given}: expert parallelism is for the language model's experts "
                   f"(the {s.name} encoder has none); set ep=1 and drop etp on {s.name}")
