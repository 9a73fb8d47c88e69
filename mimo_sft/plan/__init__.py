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

The modules: ``flags`` (those flags), ``build`` (the figures, :func:`build_plan`), ``command`` (the
CLI entry, :func:`run_plan`), ``inputs`` (the micro-batches' counts from the data layer),
``simulate`` (the reorder simulation, pure), ``positions``, ``memory`` and ``report`` (table, PNG).
Importing the package stays cheap: the heavy modules load when a plan is built.
"""

from __future__ import annotations

from mimo_sft.plan.build import build_plan
from mimo_sft.plan.command import run_plan
from mimo_sft.plan.flags import DEFAULT_STEPS, PlanOptions, split_plan_args

__all__ = ["DEFAULT_STEPS", "PlanOptions", "build_plan", "run_plan", "split_plan_args"]
