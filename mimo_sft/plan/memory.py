"""``plan``'s memory forecast: check 23's terms on the data's heaviest micro-batch instead of the worst case.

``validate`` and ``finetune`` forecast the largest micro-batch the data can form where ``check-data
--write-costs`` counted its rows (``memory.from_data``), else every sample at ``--seq-length`` filled with image
tokens; ``plan`` does the same with the counts, and without them, having read the first micro-batches, forecasts
the heaviest of the planned ones as training will place it (after reordering when the config reorders): the most patches on one
vision rank, the most positions on one language rank (real tokens with ``--in-batch-packing``, padded
rows otherwise) and the most image tokens reaching one language rank.
"""

from __future__ import annotations

from mimo_sft.data.reorder.load_bounds import loads_before_after
from mimo_sft.memory.forecast import Workload
from mimo_sft.parallel.layout import IMAGES, LANGUAGE


def data_workload(cfg, layout, mbs_list, traces: dict, merge: int) -> Workload:
    """The heaviest per-rank loads over ``mbs_list`` (``plan.simulate.MicroBatchLoad``) and their traces."""
    side = "after" if cfg.reorder.enabled else "before"
    patches = max((max(loads) for loads in getattr(traces[IMAGES], side)), default=0)
    lang = layout.spec(LANGUAGE)
    per_rank = cfg.train.micro_batch_size // lang.dp
    if cfg.data.in_batch_packing:
        tokens = max((max(loads) for loads in getattr(traces[LANGUAGE], side)), default=0)
    else:
        tokens = per_rank * cfg.data.seq_length
    image_tokens = 0
    for mb, order in zip(mbs_list, traces[LANGUAGE].orders):
        before, after = loads_before_after(mb.patches, order, layout.canonical_grid, lang.dp)
        image_tokens = max(image_tokens, max(after if cfg.reorder.enabled else before) / merge ** 2)
    return Workload(language_tokens=int(tokens), image_patches=int(patches), image_tokens=int(image_tokens),
                    source=f"this data: heaviest of {len(mbs_list)} planned micro-batches "
                           f"({int(patches):,} patches on one vision rank, {int(tokens):,} positions on one language rank)")


def plan_memory(cfg, layout, mbs_list, traces: dict) -> dict | None:
    """Check 23 on the data: ``{"forecast", "budget_bytes", "budget_source", "problems"}``, or None
    when it cannot forecast (no config.json, a layout the other checks refuse). Where check-data counted every
    row for these settings, the largest micro-batch those rows can form (``memory.from_data``, what validate and
    finetune hold the run to); else the heaviest of the planned micro-batches."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.from_data import data_workload as largest_workload
    from mimo_sft.validate import check_config, data_row_counts

    hf = read_hf_config(cfg.model.hf_model)
    if hf is None or "vision_config" not in hf:
        return None
    counts, _ = data_row_counts(cfg)
    if counts is not None and not counts.unknown:
        wl = largest_workload(cfg, layout, hf, counts)
    else:
        wl = data_workload(cfg, layout, mbs_list, traces, hf["vision_config"].get("spatial_merge_size", 2))
    result = check_config(cfg, for_run=True, workload=wl, row_counts=None)
    if result.memory is None:
        return None
    return {**result.memory, "problems": [str(p) for p in result.problems if p.check == 23]}
