"""The figures of ``mimo-sft plan`` (:func:`build_plan`), one named step per part of the plan dict.

Why steps: every part mirrors a different piece of training (the checks, the reorder simulation,
the language positions, the exchange's bytes, the memory forecast), and a step per part can be read
next to the code it mirrors. The heavy modules (``plan.simulate`` and the data layer: torch,
datasets) are imported inside the steps, so ``import mimo_sft.plan`` (``mimo-sft plan --help``)
stays cheap.
"""

from __future__ import annotations

from mimo_sft.config.mixture import dataset_label
from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import IMAGES, LANGUAGE
from mimo_sft.plan.flags import PlanOptions


def build_plan(cfg, opts: PlanOptions) -> dict:
    """Every figure of the plan as one JSON-ready dict: what ``--json`` prints and the table reads.

    Keys: ``steps``, ``modules.{images,language}`` (``max_over_mean_before/_after``, their ``_p95``,
    ``spread_*`` = mean heaviest-minus-lightest rank, ``wait_share_*`` = mean 1 - mean/max, and
    ``per_micro_batch`` series; colocated layouts add ``gpus``: each canonical group's GPU load, its
    vision slice plus its share of its language DP rank, ``data.reorder.colocated_plan``), ``train_steps`` (what metrics.jsonl logs per optimizer step),
    ``compare`` (one summary per extra window / language weight), ``language_positions`` (positions
    each language rank computes per micro-batch, padded vs packed: ``plan.positions``), ``sample_ids``, ``layout``,
    ``reorder``, ``data``, ``note``, ``memory`` (check 23's forecast per module on the heaviest planned
    micro-batch, ``plan.memory``; None without a config.json) and ``memory_report`` (with the budget and
    the over-budget ``problems``).
    """
    from mimo_sft.plan.inputs import load_micro_batches
    from mimo_sft.plan.memory import plan_memory

    layout = _valid_layout(cfg)
    _check_reorder_settings(cfg.reorder)
    mbs_list, facts = load_micro_batches(cfg, layout, opts.steps)
    patch_bytes = facts.pop("patch_bytes")  # the exchange's bytes per patch: a figure of its own, not a data fact
    main, compare = _simulate(cfg, layout, mbs_list, opts)
    memory = plan_memory(cfg, layout, mbs_list, main)
    per_step = cfg.train.global_batch_size // cfg.train.micro_batch_size
    modules, train_steps = _load_figures(main, per_step)
    return {
        "memory": memory["modules"] if memory else None,
        "memory_report": memory,
        "steps": opts.steps,
        "micro_batch_size": cfg.train.micro_batch_size,
        "micro_batches_per_step": per_step,
        "canonical_grid": layout.canonical_grid,
        "layout": {s.name: {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ranks": f"{s.rank_offset}-{s.rank_offset + s.size - 1}"}
                   for s in layout.components},
        "reorder": _reorder_figures(cfg, layout, mbs_list, main, patch_bytes),
        "note": None if cfg.reorder.enabled else ("reordering is OFF in this config; 'after' shows what "
                                                  "--intra-microbatch-reorder would do"),
        "data": {"dataset_path": dataset_label(cfg.data), "dataloader_type": cfg.data.dataloader_type,
                 "seed": cfg.train.seed, "seq_length": cfg.data.seq_length, **facts},
        "sample_ids": [mb.sample_ids for mb in mbs_list],
        "not_checked": (f"plan read the chat text and image headers of the first {opts.steps} micro-batches only; "
                        "it decodes no pixels and skips every other row: run `mimo-sft check-data` with the same "
                        "flags to decode every sample"),
        "modules": modules,
        "language_positions": _language_positions(cfg, layout, mbs_list, main),
        "train_steps": train_steps,
        "compare": compare,
    }


def _valid_layout(cfg):
    """The layout, or one UserError line naming the first problem training would refuse."""
    from mimo_sft.validate import check_config

    result = check_config(cfg, for_run=True, row_counts=None)
    # check 23 forecasts the worst case; the plan forecasts this data's heaviest micro-batch instead
    problems = [p for p in result.problems if p.check != 23]
    if problems:
        msgs = [str(p) for p in problems]
        more = f" (+{len(msgs) - 1} more; `mimo-sft validate` lists them all)" if len(msgs) > 1 else ""
        raise UserError(f"invalid config: {msgs[0]}{more}", problems=msgs)
    layout = result.layout
    if IMAGES not in layout.names:
        raise UserError("plan: the layout has no 'images' module; add --component 'images=tp=1,dp=N,rank_offset=R'")
    return layout


def _check_reorder_settings(r) -> None:
    """Refuse bad cost weights and windows even with reordering off: ``check_config`` checks them only
    with reordering on, and the plan shows what reordering would do either way. Bad weights raise the
    training loop's own UserError (``simulate.check_weights``)."""
    from mimo_sft.plan import simulate

    simulate.check_weights(r.encoder_cost_weight, r.language_cost_weight)
    if r.window_size < 1:
        raise UserError(f"--reorder-window-size={r.window_size} must be >= 1")


def _dp_sizes(layout) -> dict[str, int]:
    return {IMAGES: layout.spec(IMAGES).dp, LANGUAGE: layout.language.dp}


def _simulate(cfg, layout, mbs_list, opts: PlanOptions) -> tuple[dict, list[dict]]:
    """The configured window and weights' traces, and one summary row per ``--compare-*`` value.

    Every row runs the same ``simulate.trace`` on the same micro-batches, so rows differ only in the
    value they vary (a compare weight is checked as the configured ones are, before its row runs).
    """
    from mimo_sft.plan import simulate

    r = cfg.reorder

    colocated = None
    if layout.colocated:  # every GPU runs both modules: the per-GPU plan (data.reorder.colocated_plan)
        from mimo_sft.data.reorder.colocated_plan import ColocatedGrid

        colocated = ColocatedGrid.from_layout(layout)

    def run(window: int, lang_w: float) -> dict:
        return simulate.trace(mbs_list, n_groups=layout.canonical_grid, dp_sizes=_dp_sizes(layout),
                              encoder_cost_weight=r.encoder_cost_weight, language_cost_weight=lang_w,
                              window_size=window, colocated=colocated)

    main = run(r.window_size, r.language_cost_weight)
    compare = [_compare_row("window", w, r.language_cost_weight, run(w, r.language_cost_weight)) for w in opts.windows]
    for lw in opts.language_weights:
        simulate.check_weights(r.encoder_cost_weight, lw)
        compare.append(_compare_row("language_cost_weight", r.window_size, lw, run(r.window_size, lw)))
    return main, compare


def _compare_row(varied: str, window: int, lang_w: float, tr: dict) -> dict:
    from mimo_sft.plan.simulate import summarize

    row = {"varied": varied, "window_size": window, "language_cost_weight": lang_w}
    row.update({name: summarize(t) for name, t in tr.items()})
    return row


def _load_figures(main: dict, per_step: int) -> tuple[dict, dict]:
    """Per module the summary and per-micro-batch series (the table, the PNG), and the per-step
    max/mean figures metrics.jsonl logs (``vision_load_*`` / ``language_load_*``), to compare with a run."""
    from mimo_sft.plan import simulate

    modules = {name: {**simulate.summarize(tr), "per_micro_batch": simulate.per_micro_batch(tr)}
               for name, tr in main.items()}
    train_steps = {
        "vision_load_max_over_mean": simulate.training_steps(main[IMAGES], per_step),
        "language_load_max_over_mean": simulate.training_steps(main[LANGUAGE], per_step),
    }
    return modules, train_steps


def _reorder_figures(cfg, layout, mbs_list, main: dict, patch_bytes) -> dict:
    """The reorder settings the plan ran with, and the bytes each ``--reorder-mode`` moves between ranks
    per micro-batch (index mode none: every rank reads what it owns; exchange mode the samples that move)."""
    from mimo_sft.plan import simulate

    r = cfg.reorder
    exchange = None  # colocated layouts reorder by index only (check 11)
    if not layout.colocated:
        exchange = _mean(simulate.exchange_bytes(mbs_list, main[LANGUAGE].orders, dp_sizes=_dp_sizes(layout),
                                                 seq_length=cfg.data.seq_length, patch_bytes=patch_bytes))
    return {"enabled_in_config": r.enabled, "encoder_cost_weight": r.encoder_cost_weight,
            "language_cost_weight": r.language_cost_weight, "window_size": r.window_size,
            "mode": r.mode, "bytes_per_micro_batch": {"index": 0.0, "exchange": exchange},
            "calibration": r.calibration or None}


def _language_positions(cfg, layout, mbs_list, main: dict) -> dict:
    """Positions each language rank computes per micro-batch, padded vs packed, in the order training
    would use: reordered only when the config reorders (unlike 'after', which shows reordering either way)."""
    from mimo_sft.plan.positions import language_positions

    orders = main[LANGUAGE].orders if cfg.reorder.enabled else None
    positions = language_positions([mb.tokens for mb in mbs_list], orders, layout.language.dp,
                                   seq_length=cfg.data.seq_length, pad_to_seq_length=cfg.data.pad_to_seq_length)
    positions["in_batch_packing"] = cfg.data.in_batch_packing
    cp = layout.language.cp  # context parallelism: each cp rank computes 1/cp of its DP rank's positions
    positions["cp"] = cp
    for key in ("padded_per_rank", "packed_per_rank"):
        positions[key] /= cp
    return positions


def _mean(values) -> float:
    return float(sum(values) / len(values)) if values else 0.0
