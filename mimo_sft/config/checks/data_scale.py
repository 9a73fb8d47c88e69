"""Check 25: data loading at cluster scale (workers, bad samples, the reorder mode).

A sibling of ``config.checks`` (registered in its ``CHECKS`` tuple); pure, like every check.
"""

from __future__ import annotations


def c25_data_scale(ctx):
    d, r = ctx.cfg.data, ctx.cfg.reorder
    if d.num_workers < -1:
        yield f"--num-workers={d.num_workers} must be >= 0, or -1 to pick from the CPUs of each rank"
    if d.max_bad_samples < 0:
        yield f"--max-bad-samples={d.max_bad_samples} must be >= 0 (0: stop at the first bad sample)"
    if r.enabled and r.mode == "exchange":
        yield ("--reorder-mode exchange: ranks decode their own shard and send the samples the plan moves to other "
               "ranks over gloo (reorder_bytes in the metrics); --reorder-mode index moves none", "note")
