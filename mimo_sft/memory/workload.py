"""What one rank computes per micro-batch, the input of the memory forecast (``memory.forecast``): the worst
case a sample could reach (``forecast.worst_case_workload``), the largest micro-batch a dataset's per-row counts
can form (``memory.from_data``), or plan's heaviest planned micro-batch (``plan.memory``). Its own module so
that the forecast and the data bound both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Workload:
    """What one rank computes per micro-batch: the forecast's worst case, or a dataset's heaviest."""

    language_tokens: int
    image_patches: int
    image_tokens: int  # image tokens reaching one language rank
    source: str
    #: the most padded attention slots (``model.segments``) of one language rank's packed sequence, and of one
    #: vision rank's windowed and full-attention blocks (``memory.from_data``); None: padding not counted (the
    #: worst case, plan's planned micro-batches)
    language_slots: int | None = None
    window_slots: int | None = None
    image_slots: int | None = None
    #: the largest image or clip temporal patch, in patches (``memory.from_data``): what a tower replica may take
    #: beyond its even share (``train.tower_split``); None: bounded by --max-pixels
    unit_patches: int | None = None
