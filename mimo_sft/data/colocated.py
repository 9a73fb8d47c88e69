"""Colocated layouts: which shard a rank reads, and how it is cut into its language and encoder parts.

On a colocated layout every rank runs the language model and the encoder, usually with different
DP sizes. DP sizes divide one another, so the shard of the module with the smaller DP size contains
the shard of the other: a rank reads that (coarser) shard once (:func:`colocated_read_plan`), decodes
only the images of its encoder DP slice (each image is decoded by one rank of the bridge group,
not by all), and :class:`ColocatedSplit` keeps the language fields of its language DP slice with
those pixels. megatron's ColocatedBridgeCommunicator then moves encoder output between the
two DP layouts; where the DP sizes differ (:func:`bridge_pads`) the split also hands over what
``train.bridge.PaddedBridge`` needs to cut that output on sample boundaries: the image tokens of
each sample of the encoder slice and the most image tokens of any sample of the read shard.

With ``--intra-microbatch-reorder`` (index mode) the shard a rank reads is its part of the
micro-batch laid out by the per-GPU plan (``data.reorder.colocated_plan``) instead of as sampled; the
slices and the split are the same.

Everything here is pure (no collective).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mimo_sft.data.reorder.serialize import merge_samples, split_samples
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


def bridge_pads(layout) -> bool:
    """Whether the encoder and language DP sizes differ (megatron's bridge fans in or out): then the
    bridge pads every sample's encoder output to one length (``train.bridge``), and the split hands
    it the per-sample counts."""
    return bool(layout.encoders) and len({s.dp for s in layout.encoders} | {layout.language.dp}) > 1


def image_tokens_per_sample(batch: dict, image_token_id: int) -> torch.Tensor:
    """int64 ``[B]``: image placeholder tokens of each sample of ``batch`` (pure)."""
    return (batch["input_ids"] == image_token_id).sum(dim=1).to(torch.int64)


class ColocatedSplit:
    """Cuts a read shard into this rank's micro-batch: language fields of the language slice, pixels
    of the encoder slice. ``bridge`` (:func:`bridge_pads`): also add ``encoder_image_tokens`` (image
    tokens per sample of the encoder slice) and ``bridge_tokens_per_sample`` (the most image tokens
    of any sample of the read shard, a Python int) for the padded bridge (design.md's micro-batch
    table). Every rank of a bridge gather group reads the same shard, so all compute the same value."""

    def __init__(self, language: slice, encoder: slice, *, image_token_id: int, bridge: bool = False):
        self.language = language
        self.encoder = encoder
        self.image_token_id = image_token_id
        self.bridge = bridge

    @classmethod
    def for_plan(cls, plan: ColocatedReadPlan, layout, *, image_token_id: int) -> "ColocatedSplit":
        return cls(plan.language, plan.encoder, image_token_id=image_token_id, bridge=bridge_pads(layout))

    def __call__(self, batch: dict) -> dict:
        """``batch``: the read shard, whose pixels are already only the encoder slice's (the data
        layer decodes only those: ``build_microbatch_iterator(pixel_slice=...)``, each image once)."""
        records = split_samples({k: v for k, v in batch.items() if k not in PIXEL_KEYS})
        lang = merge_samples(records[self.language])
        counts = batch["image_counts"][self.encoder]
        assert int(counts.sum()) == batch["image_grid_thw"].shape[0], "pixels are not the encoder slice's"
        lang["pixel_values"] = batch["pixel_values"]
        lang["image_grid_thw"] = batch["image_grid_thw"]
        if self.bridge:
            tokens = image_tokens_per_sample(batch, self.image_token_id)
            lang["encoder_image_tokens"] = tokens[self.encoder].clone()
            lang["bridge_tokens_per_sample"] = int(tokens.max()) if tokens.numel() else 0
        return lang
