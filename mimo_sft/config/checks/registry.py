"""The numbered registry: every check in order, and the one function that runs them all.

``check_config`` returns every problem at once (``validate`` prints them all; ``finetune`` runs the same
function on every rank before step 0 and refuses to start). Numbers are stable (messages and docs cite
them). Each check is a generator over a ``CheckContext`` yielding a message, or ``(message, "note")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mimo_sft.config.checks import (checkpoint, data, data_scale, deepstack, family, memory, model, overlap, paths,
                                    training, validation)
from mimo_sft.config.checks import layout as layout_checks
from mimo_sft.config.checks.context import CheckContext, Problem, read_hf_config
from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import Layout


CHECKS: tuple[tuple[int, str, Callable], ...] = (
    (1, "sizes are positive", layout_checks.c01_positive_sizes),
    (2, "modules given", layout_checks.c02_components_present),
    (3, "language module present", layout_checks.c03_language_present),
    (4, "modules are model modalities", layout_checks.c04_module_names),
    (5, "rank ranges tile the world", layout_checks.c05_rank_ranges),
    (6, "TP is a power of two", layout_checks.c06_tp_power_of_two),
    (7, "DP sizes divide one another", layout_checks.c07_dp_divisibility),
    (8, "micro-batch fits the canonical grid", layout_checks.c08_micro_batch),
    (9, "global batch is whole micro-batches", layout_checks.c09_global_batch),
    (10, "encoder layout is supported", layout_checks.c10_encoder_limits),
    (11, "colocated layout is supported", layout_checks.c11_colocated),
    (12, "language partition is supported", layout_checks.c12_language_partition),
    (13, "reordering settings", data.c13_reorder),
    (14, "scalable data parallelism settings", data.c14_scalable_dp),
    (15, "checkpoint flags", checkpoint.c15_checkpoints),
    (16, "model folder and divisibility", model.c16_model),
    (17, "dataset settings", data.c17_data),
    (18, "what is left to finetune", model.c18_contents_note),
    (19, "in-batch packing and attention kernel settings", data.c19_packing),
    (20, "LoRA settings", training.c20_lora),
    (21, "activation recomputation settings", memory.c21_recompute),
    (22, "sequence parallelism settings", memory.c22_sequence_parallel),
    (23, "memory forecast fits the GPU", memory.c23_memory),
    (24, "checkpoint writing and resharding", checkpoint.c24_checkpoint_writing),
    (25, "data loading at scale", data_scale.c25_data_scale),
    (26, "run output folders are usable", paths.c26_run_folders),
    (27, "export and debugging folders are usable", paths.c27_extra_folders),
    (28, "validation settings", validation.c28_validation),
    (29, "learning rates and experiment trackers", training.c29_learning_rates_and_trackers),
    (30, "model family matches the checkpoint", family.c30_model_family),
    (31, "DeepStack layers on the first language stage", deepstack.c31_deepstack_stages),
    (33, "overlapped reduction and profiler settings", overlap.c33_overlap_and_profiler),
    (34, "export shard size", checkpoint.c34_export_shards),
    (35, "resume keeps the data order", checkpoint.c35_resumed_data_order),
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


def check_config(cfg: ExperimentConfig, *, forecaster: Callable, world_size: int | None = None,
                 for_run: bool = False, workload=None) -> CheckResult:
    """Run every check; never raises for config problems (they come back in ``problems``).
    ``forecaster``: check 23's body (``memory.check.forecast_check``; callers use ``mimo_sft.validate``, which
    passes it). ``workload``: a ``memory.forecast.Workload`` to forecast instead of the worst case (``plan``)."""
    try:
        specs = cfg.parallel.specs()
    except UserError as e:
        return CheckResult(None, [Problem(2, str(e))], [], None)
    world = world_size if world_size is not None else cfg.parallel.world_size
    sane = specs and all(min(s.tp, s.pp, s.cp, s.dp, s.ep, s.expert_tp) >= 1 and s.rank_offset >= 0 for s in specs)
    layout = Layout.from_specs(specs, world) if sane else None
    ctx = CheckContext(cfg, specs, layout, world, for_run,
                       read_hf_config(cfg.model.hf_model), workload=workload, forecaster=forecaster)
    problems, notes = _run(ctx, [n for n, _t, _f in CHECKS])
    return CheckResult(layout, problems, notes, ctx.hf_config, ctx.memory)


#: the checks that read only the data flags (no layout, no model): ``check-data`` applies them before any row
DATA_FLAG_CHECKS = (17,)


def data_flag_problems(cfg: ExperimentConfig) -> list[Problem]:
    """The problems ``finetune`` would refuse in the data flags alone (:data:`DATA_FLAG_CHECKS`, as for a run):
    ``check-data`` reads a dataset with them, so it refuses what finetune refuses (``--video-fps 0``, crossed
    pixel bounds, a missing image root) rather than decode with them."""
    ctx = CheckContext(cfg, [], None, None, True, None)
    return _run(ctx, DATA_FLAG_CHECKS)[0]


def _run(ctx: CheckContext, numbers) -> tuple[list[Problem], list[Problem]]:
    """``(problems, notes)`` of the checks ``numbers`` on ``ctx``, in the registry's order."""
    problems, notes = [], []
    for number, _title, fn in CHECKS:
        if number not in numbers:
            continue
        for item in fn(ctx) or ():
            msg, sev = (item, "error") if isinstance(item, str) else (item[0], item[1] if len(item) > 1 else "error")
            (notes if sev == "note" else problems).append(Problem(number, msg, sev))
    return problems, notes


def require_valid(cfg: ExperimentConfig, **kw) -> CheckResult:
    """``check_config`` that raises one UserError listing every problem (used by finetune)."""
    result = check_config(cfg, **kw)
    refuse(result.problems)
    return result


def refuse(problems: list[Problem]) -> None:
    """One UserError listing every problem (finetune's words), or nothing when there is none."""
    if problems:
        raise UserError(f"{len(problems)} problem(s) in the config: " + "; ".join(str(p) for p in problems),
                        problems=[str(p) for p in problems])
