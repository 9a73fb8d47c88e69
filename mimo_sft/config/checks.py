"""Every rule a layout and config must satisfy, checked before any process starts.

``check_config`` runs all numbered checks and returns every problem at once (``validate`` prints
them all; ``finetune`` runs the same function on every rank before step 0 and refuses to start).
Each message says what is wrong and what to change. Where a limit is mimo-sft's own choice rather
than a hard megatron limit, the message says so.

A model family's limits (its modalities, encoder and language parallelism, head and layer
divisibility, supported ``model_type`` values) are not written here: they come from the family
descriptors in ``config.families``; the checks below word them and add the layout rules.

Pure: no torch.distributed, no megatron. ``config.json`` of ``--hf-model`` is read when present to
find the family and check head and layer divisibility.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from mimo_sft.config import checks_family, checks_memory, families
from mimo_sft.config.checks_checkpoint import c24_checkpoint_writing, c34_export_shards
from mimo_sft.config.checks_data_scale import c25_data_scale
from mimo_sft.config.checks_deepstack import c31_deepstack_stages
from mimo_sft.config.checks_eval import c28_validation
from mimo_sft.config.checks_overlap import c33_overlap_and_profiler
from mimo_sft.config.checks_paths import c26_run_folders, c27_extra_folders
from mimo_sft.config.families import FamilySpec
from mimo_sft.config.checks_forecast import c23_memory
from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.errors import UserError
from mimo_sft.parallel.components import ComponentSpec
from mimo_sft.parallel.layout import LANGUAGE, Layout


@dataclass(frozen=True)
class Problem:
    check: int
    message: str
    severity: str = "error"  # "error" refuses the run; "note" is printed only

    def __str__(self) -> str:
        return f"[{self.check:02d}] {self.message}"


@dataclass
class CheckContext:
    cfg: ExperimentConfig
    specs: list[ComponentSpec]
    layout: Layout | None
    world_size: int | None
    for_run: bool
    hf_config: dict | None
    #: check 23's forecast (``config.checks_forecast``); ``workload``: plan's heaviest micro-batch, if any
    memory: dict | None = None
    workload: object = None


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# ---- checks: each yields (message) or (message, severity) -------------------------------------

def c01_positive_sizes(ctx):
    for s in ctx.specs:
        for key in ("tp", "pp", "cp", "dp", "etp"):
            if getattr(s, key) < 1:
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
    o = ctx.cfg.optimizer
    for name, val in (("--lr", o.lr), ("--min-lr", o.min_lr)):
        if val < 0:
            yield f"{name}={val} must be >= 0"
    if o.lr >= 0 and o.min_lr >= 0 and o.min_lr > o.lr:
        yield f"--min-lr={o.min_lr} is above --lr={o.lr}; lower --min-lr"
    if o.lr_warmup_iters < 0:
        yield f"--lr-warmup-iters={o.lr_warmup_iters} must be >= 0"
    if ctx.cfg.parallel.world_size is not None and ctx.cfg.parallel.world_size < 1:
        yield f"--world-size={ctx.cfg.parallel.world_size} must be >= 1"


def c02_components_present(ctx):
    if not ctx.specs:
        yield "no modules given; add --component 'language=tp=1,dp=N,rank_offset=0' and one per encoder (e.g. images)"


def c03_language_present(ctx):
    if ctx.specs and LANGUAGE not in {s.name for s in ctx.specs}:
        yield "no 'language' module; add --component 'language=tp=...,dp=...,rank_offset=...'"


def c04_module_names(ctx):
    family = _family(ctx)
    spec = _family_spec(ctx)  # an unsupported model_type is check 16's line, not a modality problem
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
        yield f"ranks {_ranges(gaps)} belong to no module; shift rank_offset so the modules tile 0..{implied - 1}"
    if world is not None and world != implied:
        yield (f"world size {world} does not match the {implied} ranks the modules use; "
               f"change --world-size or the components' dp/tp/pp/rank_offset")


def c06_tp_power_of_two(ctx):
    for s in ctx.specs:
        if s.tp >= 1 and not _pow2(s.tp):
            yield f"{s.name}.tp={s.tp} is not a power of two; use 1, 2, 4, 8 (mimo-sft's own limit)"
        if s.etp >= 1 and not _pow2(s.etp):
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
    spec = _family_spec(ctx)
    for s in ctx.specs:
        if s.name == LANGUAGE:
            continue
        yield from families.encoder_findings(spec, s, colocated=ctx.layout.colocated,
                                             language_dp=lang.dp if lang else None)
        if lang and not ctx.layout.colocated and s.dp > lang.dp:
            yield (f"{s.name}.dp={s.dp} > language.dp={lang.dp}: megatron's bridge fan-in asserts when "
                   f"image-token counts vary per sample; make {s.name}.dp <= language.dp")


def c11_colocated(ctx):
    if ctx.layout is None or not ctx.layout.colocated:
        return
    for s in ctx.specs:
        if s.pp > 1 or s.cp > 1:
            yield (f"colocated layout with {s.name}.pp={s.pp}, cp={s.cp}: megatron's "
                   f"ColocatedBridgeCommunicator needs pp=1 and cp=1; set both to 1 or give the modules disjoint ranks")
    if ctx.cfg.reorder.enabled:
        yield ("--intra-microbatch-reorder on a colocated layout is not supported (mimo-sft's own limit: "
               "it balances encoder ranks that run apart from the language model); drop the flag")


def c12_language_partition(ctx):
    lang = next((s for s in ctx.specs if s.name == LANGUAGE), None)
    if lang:
        yield from families.language_partition_findings(_family_spec(ctx), lang)


def c13_reorder(ctx):
    r = ctx.cfg.reorder
    if not r.enabled:
        return
    if not ctx.cfg.parallel.scalable_dp:
        yield "--intra-microbatch-reorder needs --scalable-dp (each rank must hold only its shard)"
    if not ctx.cfg.data.pad_to_seq_length:
        yield ("--intra-microbatch-reorder needs --pad-to-seq-length: exchanged samples are concatenated "
               "into one micro-batch, so every rank must pad to the same width")
    if r.encoder_cost_weight < 0 or r.language_cost_weight < 0:
        yield "--reorder-encoder-cost-weight and --reorder-language-cost-weight must be >= 0"
    elif r.encoder_cost_weight == 0 and r.language_cost_weight == 0:
        yield "both reorder cost weights are 0; set --reorder-encoder-cost-weight (only their ratio matters)"
    if r.window_size < 1:
        yield f"--reorder-window-size={r.window_size} must be >= 1"
    if ctx.layout is not None and all(s.dp == 1 for s in ctx.specs):
        yield ("--intra-microbatch-reorder with every module at dp=1 has nothing to balance", "note")


def c14_scalable_dp(ctx):
    if not ctx.cfg.parallel.scalable_dp:
        return
    d = ctx.cfg.data
    if not d.drop_last:
        yield "--scalable-dp needs --drop-last: every canonical group must be full in every micro-batch"
    for s in ctx.specs:
        if s.etp > 1:
            yield f"{s.name}.etp={s.etp}: expert tensor parallelism > 1 is rejected with --scalable-dp; set etp=1"


def c15_checkpoints(ctx):
    c = ctx.cfg.checkpoint
    if c.load_checkpoint and ctx.cfg.model.pretrained_checkpoint:
        yield ("--load-checkpoint and --pretrained-checkpoint are exclusive: resume a run with "
               "--load-checkpoint, or start fresh from weights with --pretrained-checkpoint")
    if c.no_save:
        t = ctx.cfg.train
        needs = [flag for flag, value in (("--save", c.save), ("--save-interval", c.save_interval),
                                          ("--export-hf", c.export_hf), ("--exit-signal-handler", t.exit_signal_handler),
                                          ("--exit-interval", t.exit_interval),
                                          ("--exit-duration-in-mins", t.exit_duration_in_mins)) if value]
        if needs:
            yield (f"--no-save with {', '.join(needs)}: those write or need a checkpoint; drop --no-save to keep "
                   f"the weights, or drop {', '.join(needs)}")
    for flag, path in (("--load-checkpoint", c.load_checkpoint), ("--pretrained-checkpoint", ctx.cfg.model.pretrained_checkpoint)):
        if path and not os.path.isdir(path):
            yield f"{flag} {path}: folder not found"


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
    elif ctx.for_run and not m.allow_random_init and not m.pretrained_checkpoint:
        yield "no model: give --hf-model DIR (a Hugging Face Qwen-VL folder)"
    elif not ctx.for_run:
        yield ("--hf-model not given: head/layer divisibility was not checked (finetune needs it)", "note")
    if m.allow_random_init and not m.hf_model:
        yield "--allow-random-init needs --hf-model (its config.json defines the architecture)"


def c18_contents_note(ctx):
    m, d = ctx.cfg.model, ctx.cfg.data
    if not ctx.for_run and (m.hf_model or d.dataset_path):
        yield ("validate checks the layout, the flags, config.json and that the paths exist and output folders are "
               "writable; it reads no weights, no rows and no images (run `mimo-sft check-data` with the same flags "
               "to decode every sample now)", "note")


def c17_data(ctx):
    d = ctx.cfg.data
    if d.dataset_path is None:
        if ctx.for_run:
            yield "no dataset: give --dataset-path (parquet/json/jsonl file or folder, or a save_to_disk folder)"
        else:
            yield ("--dataset-path not given: the data was not checked (finetune needs it)", "note")
    elif not os.path.exists(d.dataset_path) and _looks_local(d.dataset_path):
        yield f"--dataset-path {d.dataset_path}: not found; give a parquet/json/jsonl file or folder, or a save_to_disk folder"
    if d.min_pixels is not None and d.max_pixels is not None and d.min_pixels > d.max_pixels:
        yield f"--min-pixels={d.min_pixels} is above --max-pixels={d.max_pixels}"
    if d.max_image_pixels < 0:
        yield f"--max-image-pixels={d.max_image_pixels} must be >= 0 (0: no limit)"
    if d.image_root and not os.path.isdir(d.image_root):
        yield f"--image-root {d.image_root}: folder not found"


def c19_packing(ctx):
    d, m = ctx.cfg.data, ctx.cfg.model
    if not d.in_batch_packing:
        return
    if m.attention_backend != "sdpa":
        yield (f"--in-batch-packing with --attention-backend {m.attention_backend}: megatron's local core attention "
               f"cannot keep packed samples apart; use --attention-backend sdpa (the default), or "
               f"--no-in-batch-packing to compute padded rows")


def c20_lora(ctx):
    from mimo_sft.config.lora import lora_problems

    yield from lora_problems(ctx.cfg.model)
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


def _looks_local(path: str) -> bool:
    """A path rather than a hub dataset name ("org/name")."""
    return (path.startswith((".", "/", "~")) or path.endswith((".parquet", ".json", ".jsonl", ".arrow"))
            or path.count("/") != 1 or os.path.isdir(path.split("/")[0]))


CHECKS: tuple[tuple[int, str, Callable], ...] = (
    (1, "sizes are positive", c01_positive_sizes),
    (2, "modules given", c02_components_present),
    (3, "language module present", c03_language_present),
    (4, "modules are model modalities", c04_module_names),
    (5, "rank ranges tile the world", c05_rank_ranges),
    (6, "TP is a power of two", c06_tp_power_of_two),
    (7, "DP sizes divide one another", c07_dp_divisibility),
    (8, "micro-batch fits the canonical grid", c08_micro_batch),
    (9, "global batch is whole micro-batches", c09_global_batch),
    (10, "encoder layout is supported", c10_encoder_limits),
    (11, "colocated layout is supported", c11_colocated),
    (12, "language partition is supported", c12_language_partition),
    (13, "reordering settings", c13_reorder),
    (14, "scalable data parallelism settings", c14_scalable_dp),
    (15, "checkpoint flags", c15_checkpoints),
    (16, "model folder and divisibility", c16_model),
    (17, "dataset settings", c17_data),
    (18, "what is left to finetune", c18_contents_note),
    (19, "in-batch packing settings", c19_packing),
    (20, "LoRA settings", c20_lora),
    (21, "activation recomputation settings", checks_memory.c21_recompute),
    (22, "sequence parallelism settings", checks_memory.c22_sequence_parallel),
    (23, "memory forecast fits the GPU", c23_memory),
    (24, "checkpoint writing and resharding", c24_checkpoint_writing),
    (25, "data loading at scale", c25_data_scale),
    (26, "run output folders are usable", c26_run_folders),
    (27, "export and debugging folders are usable", c27_extra_folders),
    (28, "validation settings", c28_validation),
    (29, "learning rates and experiment trackers", c29_learning_rates_and_trackers),
    (30, "model family matches the checkpoint", checks_family.c30_model_family),
    (31, "DeepStack layers on the first language stage", c31_deepstack_stages),
    (33, "overlapped reduction and profiler settings", c33_overlap_and_profiler),
    (34, "export shard size", c34_export_shards),
)


@dataclass
class CheckResult:
    layout: Layout | None
    problems: list[Problem]
    notes: list[Problem]
    hf_config: dict | None
    #: check 23's forecast, ``memory.forecast.MemoryForecast.report`` (JSON-ready), or None
    memory: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _family(ctx) -> str | None:
    return (ctx.hf_config or {}).get("model_type")


def _family_spec(ctx) -> FamilySpec:
    """The family of ``--hf-model``'s config.json; the default family without one or for an unsupported
    ``model_type`` (check 16 refuses that), so the layout is still checked against a family's limits."""
    return families.family_for_model_type(_family(ctx)) or families.default_family()


def _ranges(values: list[int]) -> str:
    out, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(out)


def read_hf_config(path: str | None) -> dict | None:
    if not path:
        return None
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def check_config(cfg: ExperimentConfig, *, world_size: int | None = None, for_run: bool = False,
                 workload=None) -> CheckResult:
    """Run every check; never raises for config problems (they come back in ``problems``).
    ``workload``: a ``memory.forecast.Workload`` to forecast instead of the worst case (``plan``)."""
    try:
        specs = cfg.parallel.specs()
    except UserError as e:
        return CheckResult(None, [Problem(2, str(e))], [], None)
    world = world_size if world_size is not None else cfg.parallel.world_size
    sane = specs and all(min(s.tp, s.pp, s.cp, s.dp, s.etp) >= 1 and s.rank_offset >= 0 for s in specs)
    layout = Layout.from_specs(specs, world) if sane else None
    ctx = CheckContext(cfg, specs, layout, world, for_run,
                       read_hf_config(cfg.model.hf_model), workload=workload)
    problems, notes = [], []
    for number, _title, fn in CHECKS:
        for item in fn(ctx) or ():
            msg, sev = (item, "error") if isinstance(item, str) else (item[0], item[1] if len(item) > 1 else "error")
            (notes if sev == "note" else problems).append(Problem(number, msg, sev))
    return CheckResult(layout, problems, notes, ctx.hf_config, ctx.memory)


def require_valid(cfg: ExperimentConfig, **kw) -> CheckResult:
    """``check_config`` that raises one UserError listing every problem (used by finetune)."""
    result = check_config(cfg, **kw)
    if result.problems:
        raise UserError(
            f"{len(result.problems)} problem(s) in the config: " + "; ".join(str(p) for p in result.problems),
            problems=[str(p) for p in result.problems],
        )
    return result
