"""Check 33: overlapped gradient reduction / parameter gather, and the profiler's steps, ranks and folder.

Pure, like ``config.checks`` (which registers :func:`c33_overlap_and_profiler` in its ``CHECKS``
tuple). The readings of these settings live here once: ``train.setup`` asks
:func:`overlap_param_gather_in_use` what to build, ``train.profile`` parses ``--profile-steps`` and
``--profile-ranks`` with :func:`parse_profile_steps` / :func:`parse_profile_ranks`.

Why a refusal and not a silent fallback: megatron's DDP ignores ``--ddp-bucket-size`` without
overlapped reduction (one bucket), and its param-gather overlap exists only for the distributed
optimizer and only together with overlapped reduction (Megatron-LM's own argument rules); a flag
that would do nothing is named instead.
"""

from __future__ import annotations

import os
from typing import Optional

from mimo_sft.config.checks.paths import folder_problem
from mimo_sft.config.lora import distributed_optimizer_in_use


def overlap_param_gather_in_use(cfg) -> bool:
    """Whether the run all-gathers updated weights during the next forward (megatron DDP's forward
    pre-hooks): ``--overlap-param-gather`` as given, else on wherever it can be (the distributed
    optimizer with ``--overlap-grad-reduce``)."""
    o = cfg.optimizer
    if o.overlap_param_gather is not None:
        return bool(o.overlap_param_gather)
    return bool(o.overlap_grad_reduce) and distributed_optimizer_in_use(cfg)


def parse_profile_steps(text, train_iters: Optional[int] = None) -> Optional[tuple[int, int]]:
    """``"3:5"`` -> (3, 5), the 1-based steps A..B that are profiled; ``"4"`` -> (4, 4); None when
    unset. ValueError naming ``--profile-steps`` and the fix for anything else."""
    if text is None:
        return None
    s = str(text).strip()
    first, sep, last = s.partition(":")
    try:
        a = int(first)
        b = int(last) if sep else a
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: give the first and last step to profile as A:B "
                         f"(1-based, e.g. 3:4) or one step") from None
    if a < 1:
        raise ValueError(f"--profile-steps {text}: steps count from 1; start at step 1 or later")
    if a > b:
        raise ValueError(f"--profile-steps {text}: the first step {a} comes after the last {b}; give A:B with A <= B")
    if train_iters is not None and b > train_iters:
        raise ValueError(f"--profile-steps {text}: step {b} is beyond the run's --train-iters {train_iters}; "
                         f"profile steps within 1:{train_iters}")
    return a, b


def parse_profile_ranks(text, world_size: Optional[int] = None) -> Optional[frozenset[int]]:
    """``"0,3"`` -> {0, 3}; None (unset) means every rank. ValueError naming ``--profile-ranks``."""
    if text is None:
        return None
    try:
        ranks = frozenset(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--profile-ranks {text!r}: give comma-separated rank numbers, e.g. 0,2") from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--profile-ranks {text!r}: give comma-separated ranks >= 0, e.g. 0,2")
    if world_size is not None and max(ranks) >= world_size:
        raise ValueError(f"--profile-ranks {text}: rank {max(ranks)} does not exist in a run of "
                         f"{world_size} ranks (0-{world_size - 1})")
    return ranks


def profile_folder(cfg) -> str:
    """Where the traces go: ``--profile-dir``, else OUTPUT_DIR/profile."""
    return cfg.logging.profile_dir or os.path.join(cfg.logging.output_dir, "profile")


def _overlap_problems(cfg):
    o = cfg.optimizer
    if o.overlap_param_gather and not distributed_optimizer_in_use(cfg):
        why = ("LoRA runs use the plain optimizer" if cfg.model.lora_rank > 0
               else "--no-use-distributed-optimizer is set")
        yield (f"--overlap-param-gather needs the distributed optimizer ({why}): only its sharded weights are "
               f"all-gathered; drop --overlap-param-gather")
    if o.overlap_param_gather and not o.overlap_grad_reduce:
        yield ("--overlap-param-gather needs --overlap-grad-reduce (megatron dispatches the next step's gather "
               "from the overlapped reduction's buckets); drop --no-overlap-grad-reduce or --overlap-param-gather")
    if o.ddp_bucket_size is not None:
        if o.ddp_bucket_size < 1:
            yield f"--ddp-bucket-size={o.ddp_bucket_size} must be a positive number of parameters, e.g. 40000000"
        elif not o.overlap_grad_reduce:
            yield ("--ddp-bucket-size has no effect with --no-overlap-grad-reduce (megatron then reduces one "
                   "bucket after backward); drop one of the two")


def _profile_problems(ctx):
    cfg = ctx.cfg
    lg = cfg.logging
    if lg.profile_steps is None:
        given = [f for f, v in (("--profile-ranks", lg.profile_ranks), ("--profile-dir", lg.profile_dir)) if v]
        if given:
            yield f"{', '.join(given)} without --profile-steps: add --profile-steps A:B (e.g. 3:4)"
        return
    try:
        parse_profile_steps(lg.profile_steps, cfg.train.train_iters)
    except ValueError as e:
        yield str(e)
    try:
        parse_profile_ranks(lg.profile_ranks, ctx.layout.world_size if ctx.layout is not None else None)
    except ValueError as e:
        yield str(e)
    folder = profile_folder(cfg)
    problem = folder_problem(folder)
    if problem:
        flag = "--profile-dir" if lg.profile_dir else "--output-dir"
        yield f"{flag}: the profile folder {folder} {problem}; choose a folder that can hold the traces (--profile-dir)"


def c33_overlap_and_profiler(ctx):
    """Overlap flags that megatron would ignore or cannot honour, and profiler settings outside the run."""
    yield from _overlap_problems(ctx.cfg)
    yield from _profile_problems(ctx)
