"""Language positions each rank computes per micro-batch, padded vs in-batch packed (pure).

The language model's work is set by the positions it computes, not by the real tokens: padded rows
cost ``samples x width`` (``--seq-length`` with ``--pad-to-seq-length``, else the rank's longest
sample), a packed micro-batch (``--in-batch-packing``) costs its real tokens. ``mimo-sft plan``
shows both, on the samples each language rank will hold (after reordering when the config
reorders), so a user sees what packing saves before spending GPU time.
"""

from __future__ import annotations

from typing import Sequence


def rank_slices(n: int, dp: int, order: Sequence[int] | None) -> list[list[int]]:
    """The sample indices each of ``dp`` ranks holds when a micro-batch of ``n`` is laid out as
    ``order`` (None: as read), the slicing ``load_bounds.rank_loads`` uses."""
    order = list(range(n)) if order is None else list(order)
    per = n // dp
    return [order[r * per:(r + 1) * per] for r in range(dp)]


def language_positions(tokens_per_mb: Sequence[Sequence[float]], orders: Sequence[Sequence[int]] | None, dp: int, *,
                       seq_length: int, pad_to_seq_length: bool) -> dict:
    """Per-micro-batch per-rank positions ``padded`` and ``packed``, and their summary.

    ``tokens_per_mb``: each micro-batch's real tokens per sample (canonical order); ``orders``: the
    layout of each micro-batch (None: as read). Summary keys: ``padded_per_rank`` / ``packed_per_rank``
    (mean over micro-batches and ranks), ``padding_fraction`` (share of padded positions that are
    padding), ``max_over_mean_padded`` / ``_packed`` (heaviest rank over the mean rank, averaged over
    micro-batches: packing makes each rank's work its real tokens, so reordering by language cost
    balances it).
    """
    padded, packed = [], []
    for k, tokens in enumerate(tokens_per_mb):
        slices = rank_slices(len(tokens), dp, orders[k] if orders is not None else None)
        width = [seq_length if pad_to_seq_length else max((tokens[i] for i in s), default=0) for s in slices]
        padded.append([len(s) * w for s, w in zip(slices, width)])
        packed.append([float(sum(tokens[i] for i in s)) for s in slices])

    def mean(rows):
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1)

    def max_over_mean(rows):
        vals = [max(r) / (sum(r) / len(r)) if sum(r) > 0 else 1.0 for r in rows]
        return sum(vals) / max(len(vals), 1)

    total_padded = sum(sum(r) for r in padded)
    return {"padded_per_rank": mean(padded), "packed_per_rank": mean(packed),
            "padding_fraction": 1.0 - sum(sum(r) for r in packed) / total_padded if total_padded else 0.0,
            "max_over_mean_padded": max_over_mean(padded), "max_over_mean_packed": max_over_mean(packed),
            "per_micro_batch": {"padded": padded, "packed": packed}}
