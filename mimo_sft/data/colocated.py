"""Colocated layouts: which shard a rank reads, and how it is cut into its language and encoder parts.

On a colocated layout every rank runs the language model and the encoder, usually with different
DP sizes. DP sizes divide one another, so the shard of the module with the smaller DP size contains
the shard of the other: a rank reads that (coarser) shard once (:func:`colocated_read_plan`) and
:class:`ColocatedSplit` keeps the language fields of its language DP slice and the pixels of its
encoder DP slice. megatron's ColocatedBridgeCommunicator then moves encoder output between the
two DP layouts.

The plan and the split are pure; :func:`check_equal_image_tokens` is the one collective (a tiny
all-reduce), run only where the bridge needs it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mimo_sft.data.reorder.serialize import merge_samples, split_samples
from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import LANGUAGE

#: fields only an encoder rank consumes; every other field is the language model's
PIXEL_KEYS = ("pixel_values", "image_grid_thw")


class ColocatedReadPlan(NamedTuple):
    """What a colocated rank reads and how it cuts it (slices index the read shard's samples)."""

    module: str        # the module whose shard is read (the one with the smaller DP size)
    dp_rank: int       # this rank's DP rank in that module
    dp_size: int       # that module's DP size
    language: slice    # this rank's language DP slice of the shard
    encoder: slice     # this rank's encoder DP slice of the shard


def colocated_read_plan(layout, rank: int, micro_batch_size: int) -> ColocatedReadPlan:
    """The read plan of ``rank`` on a colocated layout (pure): five values, see :class:`ColocatedReadPlan`."""
    coords = layout.coords(rank)
    coarse = min(layout.components, key=lambda s: (s.dp, s.name != LANGUAGE))
    shard = micro_batch_size // coarse.dp
    start = coords[coarse.name].dp * shard

    def local(module):
        n = micro_batch_size // layout.spec(module).dp
        lo = coords[module].dp * n - start
        assert 0 <= lo and lo + n <= shard, "DP sizes must divide one another"
        return slice(lo, lo + n)

    enc = layout.encoders[0].name
    return ColocatedReadPlan(coarse.name, coords[coarse.name].dp, coarse.dp, local(LANGUAGE), local(enc))


def needs_equal_image_tokens(layout) -> bool:
    """megatron's ColocatedBridgeCommunicator splits and gathers encoder output in equal parts per
    sample when the encoder and language DP sizes differ: then every sample of the global
    micro-batch needs the same image-token count."""
    return bool(layout.encoders) and len({s.dp for s in layout.encoders} | {layout.language.dp}) > 1


def image_token_span(batch: dict, image_token_id: int) -> tuple[int, int]:
    """(fewest, most) image tokens in one sample of ``batch`` (pure)."""
    counts = (batch["input_ids"] == image_token_id).sum(dim=1)
    return int(counts.min()), int(counts.max())


def check_equal_image_tokens(batch: dict, image_token_id: int, group) -> None:
    """Refuse a micro-batch whose samples differ in image tokens, on every rank of ``group`` at once
    (one tiny all-reduce over the whole micro-batch, so no rank goes on to hang in the bridge)."""
    import torch.distributed as dist

    low, high = image_token_span(batch, image_token_id)
    span = torch.tensor([-low, high], dtype=torch.int64)
    dist.all_reduce(span, op=dist.ReduceOp.MAX, group=group)
    low, high = -int(span[0]), int(span[1])
    if low != high:
        raise UserError(
            "colocated layout with different encoder and language DP sizes needs the same number of "
            f"image tokens in every sample, but this micro-batch has {low} to {high}: use fixed-size "
            "single-image data (--min-pixels equal to --max-pixels), or equal DP sizes")


class ColocatedSplit:
    """Cuts a read shard into this rank's micro-batch: language fields of the language slice, pixels
    of the encoder slice. ``check_group``: where the equal-image-token rule applies
    (:func:`needs_equal_image_tokens`), the group every rank checks it over (the world)."""

    def __init__(self, language: slice, encoder: slice, *, image_token_id: int, check_group=None):
        self.language = language
        self.encoder = encoder
        self.image_token_id = image_token_id
        self.check_group = check_group

    @classmethod
    def for_plan(cls, plan: ColocatedReadPlan, layout, *, image_token_id: int, world_group) -> "ColocatedSplit":
        return cls(plan.language, plan.encoder, image_token_id=image_token_id,
                   check_group=world_group if needs_equal_image_tokens(layout) else None)

    def __call__(self, batch: dict) -> dict:
        records = split_samples(batch)
        lang = merge_samples([{k: v for k, v in r.items() if k not in PIXEL_KEYS} for r in records[self.language]])
        enc = merge_samples([{k: v for k, v in r.items() if k in PIXEL_KEYS} for r in records[self.encoder]])
        if self.check_group is not None:
            check_equal_image_tokens(batch, self.image_token_id, self.check_group)
        lang["pixel_values"] = enc.get("pixel_values")
        lang["image_grid_thw"] = enc.get("image_grid_thw")
        return lang
