"""Colocated bridge on sample boundaries: any image sizes through megatron's ColocatedBridgeCommunicator.

Where the encoder and language DP sizes differ, megatron's communicator moves the flattened encoder
output ``[tokens, hidden]`` between them by splitting dim 0 evenly (fan-out: forward narrows,
backward all-gathers) or all-gathering it (fan-in: forward all-gathers, backward narrows). That is
only right when every sample has the same number of image tokens. :class:`PaddedBridge` wraps it:

1. pad: sample j's rows of this rank's encoder slice go to rows ``[j*L, j*L + e_j)`` of a zero
   tensor ``[n_encoder_samples * L, hidden]`` (``index_copy``: differentiable, pad rows get no
   gradient), where ``L`` is the most image tokens of any sample of the read shard;
2. megatron's communicator: its even split now falls on sample boundaries;
3. strip: ``index_select`` keeps sample j's first ``l_j`` rows of each ``L``-row block, ``l_j`` the
   image tokens of the j-th sample of this rank's language slice.

``L`` needs no communication: colocated ranks read the shard of the module with the smaller DP size
(``data.colocated.colocated_read_plan``), and every rank of a gather group reads the same shard --
checked against megatron's own gather groups when the bridges are installed
(:func:`check_gather_groups_read_one_shard`). The counts come with each micro-batch
(``encoder_image_tokens``, ``bridge_tokens_per_sample``; design.md) and are set by the forward
step (:meth:`PaddedBridge.prepare`) before the model runs.

Collectives stay matched: when ``L > 0`` every rank of the group runs the encoder, on zero images
where its encoder slice has none (``model.family.modality_inputs_from_batch``; the encoder returns
zero rows connected to its parameters), so every rank calls ``communicate``; a language slice with
no image tokens still puts the (empty) stripped output into MimoModel's embedding scatter, so the
backward reaches the communicator on every rank. When ``L == 0`` no rank of the group runs the
encoder. The index arithmetic (:func:`block_rows`, :func:`bridge_plan`) is pure.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from mimo_sft.data.colocated import colocated_read_plan, image_tokens_per_sample
from mimo_sft.train.profile import phase


class BridgePlan(NamedTuple):
    """One micro-batch's padding: ``width`` = L, rows to pad into and to keep (int64, host)."""

    width: int
    padded_rows: int           # n_encoder_samples * L
    pad_index: torch.Tensor    # [sum encoder counts]: where each encoder output row goes
    strip_index: torch.Tensor  # [sum language counts]: which padded rows the language slice keeps


def block_rows(counts: Sequence[int] | torch.Tensor, width: int) -> torch.Tensor:
    """Rows of per-sample blocks in a padded tensor (pure): the ``c_j`` rows of sample j, in order,
    are rows ``[j*width, j*width + c_j)``. int64 ``[sum(counts)]``."""
    c = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > width):
        raise ValueError(f"per-sample counts {c.tolist()} do not fit blocks of {width} rows")
    total = int(c.sum())
    first = torch.cumsum(c, 0) - c  # row of sample j's first token in the unpadded tensor
    shift = torch.arange(c.numel(), dtype=torch.int64) * width - first
    return torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(shift, c)


def bridge_plan(encoder_counts, language_counts, width: int) -> BridgePlan:
    """The padding of one micro-batch from its per-sample image-token counts (pure)."""
    enc = torch.as_tensor(encoder_counts, dtype=torch.int64).reshape(-1)
    return BridgePlan(int(width), enc.numel() * int(width), block_rows(enc, width), block_rows(language_counts, width))


def pad_blocks(x: torch.Tensor, plan: BridgePlan) -> torch.Tensor:
    """``[sum e_j, h]`` -> ``[n * L, h]`` (sample j at rows ``j*L``..), zeros elsewhere; differentiable."""
    if x.shape[0] != plan.pad_index.numel():
        raise RuntimeError(f"encoder output has {x.shape[0]} rows, its samples have {plan.pad_index.numel()} "
                           "image tokens")
    out = x.new_zeros((plan.padded_rows, *x.shape[1:]))
    return out.index_copy(0, plan.pad_index.to(x.device, non_blocking=True), x)


def strip_blocks(y: torch.Tensor, plan: BridgePlan) -> torch.Tensor:
    """The language slice's rows of a padded ``[n * L, h]`` tensor, in sample order; differentiable."""
    return y.index_select(0, plan.strip_index.to(y.device, non_blocking=True))


class PaddedBridge:
    """Stands in for a megatron ``ColocatedBridgeCommunicator`` in ``MimoModel.colocated_comms``
    (which calls ``communicate`` and ``destroy``); see the module docstring."""

    def __init__(self, comm, *, image_token_id: int):
        self.comm = comm
        self.image_token_id = image_token_id
        self._plan: BridgePlan | None = None

    def __getattr__(self, name):  # direction, scale, gather_pg, ... of the wrapped communicator
        if name == "comm":
            raise AttributeError(name)
        return getattr(self.comm, name)

    def prepare(self, batch: dict) -> None:
        """Take one micro-batch's counts (host tensors, before the copy to the device)."""
        if "bridge_tokens_per_sample" not in batch or "encoder_image_tokens" not in batch:
            raise RuntimeError("colocated micro-batch without encoder_image_tokens / bridge_tokens_per_sample "
                               "(data.colocated.ColocatedSplit with bridge=True adds them)")
        language = image_tokens_per_sample(batch, self.image_token_id)
        self._plan = bridge_plan(batch["encoder_image_tokens"], language.cpu(), int(batch["bridge_tokens_per_sample"]))

    def communicate(self, x: torch.Tensor) -> torch.Tensor:
        plan, self._plan = self._plan, None
        if plan is None:
            raise RuntimeError("PaddedBridge.communicate without prepare() for this micro-batch")
        with phase("bridge"):
            return strip_blocks(self.comm.communicate(pad_blocks(x, plan)), plan)

    def destroy(self) -> None:
        self.comm.destroy()


def check_gather_groups_read_one_shard(gather_groups: Sequence[Sequence[int]], layout, micro_batch_size: int) -> None:
    """Every rank of each bridge gather group reads the same shard (so computes the same ``L``)."""
    for group in gather_groups:
        shards = {colocated_read_plan(layout, r, micro_batch_size)[:2] for r in group}
        if len(shards) != 1:
            raise AssertionError(f"bridge gather group {list(group)} reads different shards {sorted(shards)}: "
                                 "the padded bridge needs one shard per group")


def install_padded_bridges(model, layout, *, micro_batch_size: int, image_token_id: int) -> list[PaddedBridge]:
    """Wrap each fan-in / fan-out communicator of ``model.colocated_comms`` (equal DP passes through
    unchanged); returns the wrappers, which the forward step prepares per micro-batch."""
    from megatron.core.models.mimo.comm.colocated_communicator import BridgeDirection

    bridges = []
    for key, comm in list(getattr(model, "colocated_comms", {}).items()):
        if isinstance(comm, PaddedBridge):
            bridges.append(comm)
            continue
        if comm.direction is BridgeDirection.EQUAL:
            continue
        check_gather_groups_read_one_shard(comm.gather_group_ranks, layout, micro_batch_size)
        bridge = PaddedBridge(comm, image_token_id=image_token_id)
        model.colocated_comms[key] = bridge
        bridges.append(bridge)
    return bridges


def padded_bridges(model) -> list[PaddedBridge]:
    """The padded bridges installed on ``model`` (empty where none are)."""
    return [c for c in getattr(model, "colocated_comms", {}).values() if isinstance(c, PaddedBridge)]
