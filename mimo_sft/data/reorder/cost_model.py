"""The reorder cost model: per-sample costs from fields every module holds (pure: no collectives).

Why the costs come from ``input_ids`` / ``attention_mask`` only: every module (vision ranks that
hold pixels, language ranks that never see them) computes the same costs from fields it holds, so
each derives the same assignment without talking to the others. :func:`weighted_costs` is the ONE
cost formula, shared by training (:func:`batch_costs`, :func:`make_cost_fn`) and ``mimo-sft plan``
(on counts taken from image headers and token lengths).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping, Sequence

import torch

from mimo_sft.errors import UserError


def _check_weights(encoder_cost_weight: float, language_cost_weight: float) -> None:
    """Weights come straight from flags, so a bad value is the user's to fix (UserError)."""
    if encoder_cost_weight < 0 or language_cost_weight < 0:
        raise UserError(
            f"reorder cost weights must be >= 0, got --reorder-encoder-cost-weight {encoder_cost_weight} "
            f"and --reorder-language-cost-weight {language_cost_weight}"
        )
    if encoder_cost_weight == 0 and language_cost_weight == 0:
        raise UserError(
            "--reorder-encoder-cost-weight and --reorder-language-cost-weight are both 0: make at least one positive"
        )


def patch_counts(input_ids: torch.Tensor, *, image_token_id: int, merge_size: int) -> torch.Tensor:
    """Vision patches per sample, from ``input_ids`` alone.

    Each image placeholder token stands for ``merge_size**2`` patches, so the count is identical on
    ranks that hold pixels and on language-only ranks that never see them.
    ``input_ids`` is ``[S]`` (one sample) or ``[B, S]``; returns an int64 tensor of shape ``[]`` / ``[B]``.
    """
    return (input_ids == image_token_id).sum(dim=-1) * (merge_size * merge_size)


def weighted_costs(
    patches: Sequence[float] | torch.Tensor,
    tokens: Sequence[float] | torch.Tensor | None,
    *,
    encoder_cost_weight: float,
    language_cost_weight: float = 0.0,
) -> list[float]:
    """THE cost formula, per sample: ``encoder_weight * patches + language_weight * real tokens``.

    The single definition: training reaches it through :func:`batch_costs` (counts read from
    ``input_ids`` / ``attention_mask``) and ``mimo-sft plan`` calls it on the same counts taken from
    image headers and token lengths, so the planner cannot drift from what training balances.
    float64 throughout, so the result is bit-identical whichever path the counts came from;
    ``tokens`` is not read when the language weight is 0.
    """
    cost = encoder_cost_weight * torch.as_tensor(patches, dtype=torch.float64)
    if language_cost_weight:
        if tokens is None:
            raise ValueError("language_cost_weight > 0 needs the per-sample token counts")
        cost = cost + language_cost_weight * torch.as_tensor(tokens, dtype=torch.float64)
    return [float(c) for c in cost.tolist()]


def batch_costs(
    fields: Mapping[str, torch.Tensor],
    *,
    encoder_cost_weight: float,
    language_cost_weight: float = 0.0,
    image_token_id: int,
    merge_size: int,
) -> list[float]:
    """Per-sample cost of every sample in a micro-batch: :func:`weighted_costs` of the image
    patches counted in ``input_ids`` and the real tokens counted in ``attention_mask``."""
    _check_weights(encoder_cost_weight, language_cost_weight)
    input_ids = fields["input_ids"]
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    patches = patch_counts(input_ids, image_token_id=image_token_id, merge_size=merge_size)
    tokens = None
    if language_cost_weight:
        mask = fields.get("attention_mask")
        if mask is None:
            raise ValueError("language_cost_weight > 0 needs attention_mask on every rank")
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        tokens = mask.to(torch.float64).sum(dim=-1)
    return weighted_costs(
        patches, tokens, encoder_cost_weight=encoder_cost_weight, language_cost_weight=language_cost_weight
    )


def sample_cost(fields: Mapping[str, torch.Tensor], **weights_and_ids) -> float:
    """Cost of ONE sample: :func:`batch_costs` (same keywords) of a one-sample ``fields``.

    ``fields`` holds that sample's ``input_ids`` (``[S]`` or ``[1, S]``) and, when the language
    weight is positive, its ``attention_mask``. Only fields every module holds are read.
    """
    costs = batch_costs(fields, **weights_and_ids)
    if len(costs) != 1:
        raise ValueError(f"sample_cost expects one sample, got {len(costs)}; use batch_costs")
    return costs[0]


def make_cost_fn(
    *,
    encoder_cost_weight: float = 1.0,
    language_cost_weight: float = 0.0,
    image_token_id: int,
    merge_size: int,
) -> Callable[[Mapping[str, torch.Tensor]], list[float]]:
    """A ``cost_fn(batch) -> list[float]`` for :class:`ReorderingBuffer`: :func:`batch_costs` with these
    keywords bound, the weights validated here once (a bad flag fails at setup, not at the first batch)."""
    _check_weights(encoder_cost_weight, language_cost_weight)
    return partial(batch_costs, encoder_cost_weight=encoder_cost_weight, language_cost_weight=language_cost_weight,
                   image_token_id=image_token_id, merge_size=merge_size)


def make_patch_count_fn(
    *, image_token_id: int, merge_size: int
) -> Callable[[Mapping[str, torch.Tensor]], list[float]]:
    """A ``load_fn(batch)`` giving per-sample vision patches (for the vision-load statistics)."""

    def load_fn(batch: Mapping[str, torch.Tensor]) -> list[float]:
        ids = batch["input_ids"]
        return [float(c) for c in patch_counts(ids, image_token_id=image_token_id, merge_size=merge_size).tolist()]

    return load_fn


def make_count_cost_fn(
    *, encoder_cost_weight: float = 1.0, language_cost_weight: float = 0.0, merge_size: int
) -> Callable[[Sequence[int], Sequence[int]], tuple[list[float], list[float]]]:
    """``fn(real tokens, image tokens) -> (costs, loads)``: what :func:`make_cost_fn` and
    :func:`make_patch_count_fn` give for samples with these counts, from the counts alone (a cost
    file's, ``data.cost_file``): patches ``image tokens * merge^2``, then :func:`weighted_costs`."""
    _check_weights(encoder_cost_weight, language_cost_weight)

    def fn(tokens: Sequence[int], image_tokens: Sequence[int]) -> tuple[list[float], list[float]]:
        patches = torch.as_tensor(list(image_tokens), dtype=torch.int64) * (merge_size * merge_size)
        real = torch.as_tensor(list(tokens), dtype=torch.float64) if language_cost_weight else None
        costs = weighted_costs(patches, real, encoder_cost_weight=encoder_cost_weight,
                               language_cost_weight=language_cost_weight)
        return costs, [float(p) for p in patches.tolist()]

    return fn


def make_real_token_fn() -> Callable[[Mapping[str, torch.Tensor]], list[float]]:
    """A ``cost_fn(batch)`` giving each sample's real tokens (``attention_mask.sum()``): on colocated
    layouts index mode gathers the raw counts, tokens and patches, and the planner weighs them per GPU
    (``colocated_plan.sample_terms``: the language term is shared by the language tp ranks)."""
    return _real_tokens


def _real_tokens(batch: Mapping[str, torch.Tensor]) -> list[float]:
    mask = batch["attention_mask"]
    mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
    return [float(t) for t in mask.to(torch.float64).sum(dim=-1).tolist()]


def make_count_fn(*, merge_size: int) -> Callable[[Sequence[int], Sequence[int]], tuple[list[float], list[float]]]:
    """``fn(real tokens, image tokens) -> (tokens, patches)``: :func:`make_real_token_fn` and
    :func:`make_patch_count_fn` from a cost file's counts (``data.cost_file``), for colocated plans."""

    def fn(tokens: Sequence[int], image_tokens: Sequence[int]) -> tuple[list[float], list[float]]:
        return [float(t) for t in tokens], [float(i * merge_size * merge_size) for i in image_tokens]

    return fn
