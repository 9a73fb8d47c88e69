"""Check 28: validation settings (``--valid-dataset-path``, ``--valid-split``, ``--eval-*``, ``--save-best``).

Pure, like ``config.checks`` (which registers :func:`c28_validation` in its ``CHECKS`` tuple).
:func:`parse_valid_split` and :func:`parse_eval_iters` are the one reading of ``--valid-split`` and
``--eval-iters``: the data layer uses them too.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from mimo_sft.config.checks.context import looks_local


def parse_valid_split(text) -> Optional[Union[int, float]]:
    """``"16"`` -> 16 samples, ``"0.1"`` -> a fraction, None when unset; ValueError with the reason
    for anything else."""
    if text is None:
        return None
    s = str(text).strip()
    try:
        count = int(s)
    except ValueError:
        try:
            fraction = float(s)
        except ValueError:
            raise ValueError(f"--valid-split {text!r}: give a sample count (e.g. 64) or a fraction in (0, 1) "
                             f"(e.g. 0.05)") from None
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"--valid-split {text}: a fraction must lie strictly between 0 and 1 "
                             f"(or give a sample count, e.g. 64)")
        return fraction
    if count < 1:
        raise ValueError(f"--valid-split {text}: hold out at least 1 sample (or give a fraction in (0, 1))")
    return count


def held_out(total: int, valid_split: Union[int, float], *, min_train: int) -> tuple[int, Optional[str]]:
    """``(validation rows, refusal or None)`` of ``--valid-split`` (parsed) on a source of ``total`` rows: at
    least one row is held out, and the training rows left must still fill ``min_train`` (one global batch).
    The one rule of ``data.validation.holdout_rows`` and of ``validate``'s row counts (``data.source_probe``)."""
    n_valid = max(1, valid_split if isinstance(valid_split, int) else int(round(valid_split * total)))
    if total - n_valid < min_train:
        return n_valid, (f"--valid-split {valid_split}: holding out {n_valid} of the {total} samples leaves "
                         f"{total - n_valid}, fewer than one global batch ({min_train}); hold out fewer samples")
    return n_valid, None


def parse_eval_iters(value) -> Optional[int]:
    """``--eval-iters``: ``"50"`` -> 50 global batches per evaluation, ``"all"`` -> None (the whole
    validation set); ValueError with the reason for anything else. An explicit ``0`` (the whole set
    before ``all`` existed) still means the whole set: check 28 notes it."""
    s = str(value).strip()
    if s.lower() == "all":
        return None
    try:
        count = int(s)
    except ValueError:
        raise ValueError(f"--eval-iters {value!r}: give a number of global batches (e.g. 50) or 'all' "
                         f"(the whole validation set)") from None
    if count < 0:
        raise ValueError(f"--eval-iters={value} must be >= 1 global batch, or 'all' (the whole validation set)")
    return None if count == 0 else count


def c28_validation(ctx):
    d, t, ck = ctx.cfg.data, ctx.cfg.train, ctx.cfg.checkpoint
    if d.valid_dataset_path and d.valid_split is not None:
        yield ("--valid-dataset-path and --valid-split are exclusive: evaluate on a separate set, or hold "
               "samples out of the training set, not both")
    try:
        parse_valid_split(d.valid_split)
    except ValueError as e:
        yield str(e)
    if d.valid_dataset_path and not os.path.exists(d.valid_dataset_path) and looks_local(d.valid_dataset_path):
        yield (f"--valid-dataset-path {d.valid_dataset_path}: not found; give a parquet/json/jsonl file or folder, "
               f"or a save_to_disk folder")
    if t.eval_interval is not None and t.eval_interval < 1:
        yield f"--eval-interval={t.eval_interval} must be >= 1"
    try:
        parse_eval_iters(t.eval_iters)
        if str(t.eval_iters).strip() == "0":
            yield ("--eval-iters 0 evaluates the whole validation set at every evaluation, as before; write "
                   "--eval-iters all for that (the default is now 50 global batches)", "note")
    except ValueError as e:
        yield str(e)
    has_source = bool(d.valid_dataset_path) or d.valid_split is not None
    if not has_source:
        given = [flag for flag, on in (("--eval-interval", t.eval_interval is not None),
                                       ("--eval-at-start", t.eval_at_start), ("--save-best", ck.save_best)) if on]
        if given:
            yield (f"{', '.join(given)} without a validation set: add --valid-dataset-path PATH or "
                   f"--valid-split N|FRACTION")
