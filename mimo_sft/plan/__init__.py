"""``mimo-sft plan``: what reordering will do to each rank's load on your data, before any GPU time.

Reads the dataset's image sizes and text lengths through the same metadata-only preprocessing and
canonical sampler training uses (no pixel decoded, no process started, no torch.distributed),
then, for the first ``--steps`` micro-batches of a fresh run, computes each DP rank's vision load
(patches, ``images`` module) and language load (real tokens, ``language`` module) with reordering
off and on, using the configured cost weights and window on the configured layout. When the config
has reordering off, "after" still shows what ``--intra-microbatch-reorder`` would do, and says so.

Own flags (stripped before the shared config flags reach ``load_config``)::

    --steps N                    micro-batches to simulate (default 50)
    --out DIR                    write plan.png (and plan.json) there
    --json                       print one JSON object instead of the table
    --compare-window 1,2,4       extra rows: other window sizes
    --compare-cost-weights 0,0.5 extra rows: other language cost weights
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import IMAGES, LANGUAGE

DEFAULT_STEPS = 50


@dataclass
class PlanOptions:
    steps: int = DEFAULT_STEPS
    out: str | None = None
    as_json: bool = False
    windows: list[int] = field(default_factory=list)
    language_weights: list[float] = field(default_factory=list)


def _parse_list(flag: str, text: str, kind):
    try:
        values = [kind(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated {'integers' if kind is int else 'numbers'}, "
                        f"e.g. {'1,2,4' if kind is int else '0,0.5'}") from None
    if not values:
        raise UserError(f"{flag} needs at least one value")
    return values


def split_plan_args(args: list[str]) -> tuple[PlanOptions, list[str]]:
    """Take plan's own flags out of ``args``; the rest are the shared config flags."""
    opts, rest = PlanOptions(), []
    valued = {"--steps", "--out", "--compare-window", "--compare-cost-weights"}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name == "--json" and not eq:
            opts.as_json = True
        elif name in valued:
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise UserError(f"{name} needs a value")
            if name == "--steps":
                try:
                    opts.steps = int(value)
                except ValueError:
                    raise UserError(f"--steps {value!r}: expected an integer number of micro-batches") from None
                if opts.steps < 1:
                    raise UserError(f"--steps {opts.steps} must be >= 1")
            elif name == "--out":
                opts.out = value
            elif name == "--compare-window":
                opts.windows = _parse_list(name, value, int)
                if min(opts.windows) < 1:
                    raise UserError(f"--compare-window {value}: window sizes must be >= 1")
            else:
                opts.language_weights = _parse_list(name, value, float)
                if min(opts.language_weights) < 0:
                    raise UserError(f"--compare-cost-weights {value}: language cost weights must be >= 0")
        else:
            rest.append(arg)
        i += 1
    return opts, rest


def _valid_layout(cfg):
    """The layout, or one UserError line naming the first problem training would refuse."""
    from mimo_sft.validate import check_config

    result = check_config(cfg, for_run=True)
    # check 23 forecasts the worst case; the plan forecasts this data's heaviest micro-batch instead
    problems = [p for p in result.problems if p.check != 23]
    if problems:
        msgs = [str(p) for p in problems]
        more = f" (+{len(msgs) - 1} more; `mimo-sft validate` lists them all)" if len(msgs) > 1 else ""
        raise UserError(f"invalid config: {msgs[0]}{more}", problems=msgs)
    layout = result.layout
    if layout.colocated:
        raise UserError("plan: the layout is colocated; intra-microbatch reordering balances encoder ranks that run "
                        "apart from the language model, so there is nothing to plan; give the modules disjoint ranks")
    if IMAGES not in layout.names:
        raise UserError("plan: the layout has no 'images' module; add --component 'images=tp=1,dp=N,rank_offset=R'")
    return layout


def build_plan(cfg, opts: PlanOptions) -> dict:
    """Every figure of the plan as one JSON-ready dict: what ``--json`` prints and the table reads.

    Keys: ``steps``, ``modules.{images,language}`` (``max_over_mean_before/_after``, their ``_p95``,
    ``spread_*`` = mean heaviest-minus-lightest rank, ``wait_share_*`` = mean 1 - mean/max, and
    ``per_micro_batch`` series), ``train_steps`` (what metrics.jsonl logs per optimizer step),
    ``compare`` (one summary per extra window / language weight), ``language_positions`` (positions
    each language rank computes per micro-batch, padded vs packed: ``plan.positions``), ``sample_ids``, ``layout``,
    ``reorder``, ``data``, ``note``, ``memory`` (check 23's forecast per module on the heaviest planned
    micro-batch, ``plan.memory``; None without a config.json) and ``memory_report`` (with the budget and
    the over-budget ``problems``).
    """
    from mimo_sft.plan import simulate
    from mimo_sft.plan.inputs import load_micro_batches

    layout = _valid_layout(cfg)
    r = cfg.reorder
    # check_config checks the weights and window only with reordering on; the plan runs either way.
    # Bad weights raise planning's UserError.
    simulate.check_weights(r.encoder_cost_weight, r.language_cost_weight)
    if r.window_size < 1:
        raise UserError(f"--reorder-window-size={r.window_size} must be >= 1")
    mbs_list, facts = load_micro_batches(cfg, layout, opts.steps)
    dp_sizes = {IMAGES: layout.spec(IMAGES).dp, LANGUAGE: layout.language.dp}
    grid = layout.canonical_grid
    per_step = cfg.train.global_batch_size // cfg.train.micro_batch_size

    def run(window: int, lang_w: float) -> dict:
        return simulate.trace(mbs_list, n_groups=grid, dp_sizes=dp_sizes, encoder_cost_weight=r.encoder_cost_weight,
                              language_cost_weight=lang_w, window_size=window)

    main = run(r.window_size, r.language_cost_weight)
    modules = {}
    for name, tr in main.items():
        modules[name] = {**simulate.summarize(tr), "per_micro_batch": simulate.per_micro_batch(tr)}
    compare = []
    for w in opts.windows:
        compare.append(_compare_row("window", w, r.language_cost_weight, run(w, r.language_cost_weight)))
    for lw in opts.language_weights:
        simulate.check_weights(r.encoder_cost_weight, lw)
        compare.append(_compare_row("language_cost_weight", r.window_size, lw, run(r.window_size, lw)))
    enabled = r.enabled
    from mimo_sft.plan.positions import language_positions

    orders = main[LANGUAGE].orders if enabled else None  # training reorders only when the config says so
    positions = language_positions([mb.tokens for mb in mbs_list], orders, layout.language.dp,
                                   seq_length=cfg.data.seq_length, pad_to_seq_length=cfg.data.pad_to_seq_length)
    positions["in_batch_packing"] = cfg.data.in_batch_packing
    from mimo_sft.plan.memory import plan_memory

    memory = plan_memory(cfg, layout, mbs_list, main)
    moved = simulate.exchange_bytes(mbs_list, main[LANGUAGE].orders, dp_sizes=dp_sizes, seq_length=cfg.data.seq_length,
                                    patch_bytes=facts.pop("patch_bytes"))
    return {
        "memory": memory["modules"] if memory else None,
        "memory_report": memory,
        "steps": opts.steps,
        "micro_batch_size": cfg.train.micro_batch_size,
        "micro_batches_per_step": per_step,
        "canonical_grid": grid,
        "layout": {s.name: {"dp": s.dp, "tp": s.tp, "pp": s.pp, "ranks": f"{s.rank_offset}-{s.rank_offset + s.size - 1}"}
                   for s in layout.components},
        "reorder": {"enabled_in_config": enabled, "encoder_cost_weight": r.encoder_cost_weight,
                    "language_cost_weight": r.language_cost_weight, "window_size": r.window_size,
                    "mode": r.mode, "bytes_per_micro_batch": {"index": 0.0, "exchange": _mean(moved)}},
        "note": None if enabled else ("reordering is OFF in this config; 'after' shows what "
                                      "--intra-microbatch-reorder would do"),
        "data": {"dataset_path": cfg.data.dataset_path, "dataloader_type": cfg.data.dataloader_type,
                 "seed": cfg.train.seed, "seq_length": cfg.data.seq_length, **facts},
        "sample_ids": [mb.sample_ids for mb in mbs_list],
        "not_checked": (f"plan read the chat text and image headers of the first {opts.steps} micro-batches only; "
                        "it decodes no pixels and skips every other row: run `mimo-sft check-data` with the same "
                        "flags to decode every sample"),
        "modules": modules,
        "language_positions": positions,
        "train_steps": {
            "vision_load_max_over_mean": simulate.training_steps(main[IMAGES], per_step),
            "language_load_max_over_mean": simulate.training_steps(main[LANGUAGE], per_step),
        },
        "compare": compare,
    }


def _mean(values) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _compare_row(varied: str, window: int, lang_w: float, tr: dict) -> dict:
    from mimo_sft.plan.simulate import summarize

    row = {"varied": varied, "window_size": window, "language_cost_weight": lang_w}
    row.update({name: summarize(t) for name, t in tr.items()})
    return row


def _quiet_progress_bars() -> None:
    """The plan is a report: keep datasets' "Generating train split" bars out of it (and of --json)."""
    try:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:  # pragma: no cover - datasets is a hard dependency of the data layer
        pass


def run_plan(args: list[str]) -> int:
    """CLI entry: parse, plan, print (table or JSON), write the PNG. UserError for user mistakes."""
    from mimo_sft.config.loader import load_config

    opts, rest = split_plan_args(list(args))
    cfg = load_config(rest)
    _quiet_progress_bars()
    plan = build_plan(cfg, opts)
    if opts.out:
        from mimo_sft.plan.report import write_png

        try:
            os.makedirs(opts.out, exist_ok=True)
        except OSError as err:
            raise UserError(f"--out {opts.out}: cannot create the folder ({err.strerror})") from None
        plan["png"] = write_png(plan, os.path.join(opts.out, "plan.png"))
        with open(os.path.join(opts.out, "plan.json"), "w") as fh:
            json.dump(plan, fh)
    if opts.as_json:
        print(json.dumps(plan))
    else:
        from mimo_sft.plan.report import print_plan

        print_plan(plan)
        memory = plan["memory_report"]
        if memory is not None:
            from rich.console import Console

            from mimo_sft.config.report import print_memory

            console = Console()
            print_memory(memory, console)
            for line in memory["problems"]:
                console.print(f"[red]x[/red] {line}", highlight=False, soft_wrap=True)
    return 0
