"""One optimizer step on megatron's MIMO schedules, with exact gradients for any DP ratio.

Non-colocated layouts (encoder and language on disjoint ranks) run megatron's 1F1B schedule with a
``MultiModulePipelineCommunicator``; colocated layouts run ``forward_backward_no_pipelining`` and
megatron's ``ColocatedBridgeCommunicator`` (built inside ``MimoModel``) moves encoder output
between the encoder's and the language model's DP layouts; where those differ it runs inside
``train.bridge.PaddedBridge``, which the forward step hands each micro-batch's per-sample image-token
counts, so images of any size, several per sample or none cross it exactly. With
``--in-batch-packing`` the forward step packs each language rank's padded rows into one THD sequence
(``train.packing``) after the bridge has read them, so reordering, the bridge and packing compose
(under ``--sequence-parallel`` the packed length is padded to a multiple of the language tp).

Loss is per token: every loss function returns ``(sum of token losses, token count)`` and DDP sums
(``calculate_per_token_loss=True`` pins its scaling to 1). After the DP reduction every module's
gradients are divided by the global number of supervised tokens of the step, which each rank
computes from its own data (sum of ``loss_mask`` over its micro-batches, all-reduced over its
module's DP group: every module's DP ranks together hold the whole global batch). So fan-in,
fan-out and equal DP all produce the full-batch gradient, without any cross-module message.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial, wraps
from typing import Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from mimo_sft.parallel import runtime  # first: importing mimo_sft.parallel makes megatron importable
from mimo_sft.parallel.collectives import name_group
from mimo_sft.parallel.groups import folded_grid
from mimo_sft.parallel.megatron_patches import (guard_bridge_debug_logging, host_bridge_shapes,
                                                start_pending_grad_reductions)
from mimo_sft.model.token_positions import TokenPositions
from mimo_sft.train.bridge import padded_bridges
from mimo_sft.model.context_parallel import ContextSplit
from mimo_sft.train.packing import pack_documents, pack_micro_batch, real_positions
from mimo_sft.train.profile import phase

from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY  # noqa: E402
from megatron.core.pipeline_parallel import schedules  # noqa: E402
from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator  # noqa: E402
from megatron.core.process_groups_config import MultiModuleProcessGroupCollection  # noqa: E402

LANGUAGE = MIMO_LANGUAGE_MODULE_KEY


def sum_partial_grads_over_tp(module, tp_group) -> None:
    """Sum over TP the gradients of replicated weights that each TP rank applies to its own heads
    only (marked ``tp_partial_grad``: the Gated DeltaNet output norm, ``model.norm``), which megatron's
    finalize leaves alone. One coalesced all-reduce; after megatron's DP reduction, which it commutes
    with (both are sums)."""
    if tp_group is None or tp_group.size() <= 1:
        return
    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
             for p in module.parameters() if p.requires_grad and getattr(p, "tp_partial_grad", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    coalesced = _flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=tp_group)
    for g, summed in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        g.copy_(summed)


class StepFeed(Protocol):
    """What ``StepRunner`` needs from a feed (``train.feed.Feed`` is the one the trainer builds).

    megatron's schedule pulls one micro-batch dict per ``next()``; the runner calls ``start_step``
    before the schedule and ``step_loss_tokens`` (this rank's supervised tokens of the step so far,
    all of them once the schedule has pulled every micro-batch) from the gradient finalizer.
    """

    def __iter__(self) -> Iterator[dict]: ...

    def __next__(self) -> dict: ...

    def start_step(self) -> None: ...

    def step_loss_tokens(self) -> float: ...


@dataclass
class StepOutput:
    #: on the last language stage, ``[loss sum, supervised tokens]`` over this rank's micro-batches, float64, left
    #: on the device (``train.step_log`` reads the buffered steps' sums once per log interval); None elsewhere
    sums: Optional[torch.Tensor]
    global_tokens: float  # supervised tokens of the whole global batch (every rank; counted on the host)
    #: a mixture's per-source ``[2, n_sources]`` loss sums and tokens, on the device (last language stage)
    source_sums: Optional[torch.Tensor] = None


def _language_loss(loss_mask: torch.Tensor, output: torch.Tensor, token_sources=None, n_sources: int = 0):
    """Per-token loss contract of megatron's schedules: (sum, count, values to report). A mixture's
    ``token_sources`` (each position's source number; ``n_sources``: the overflow bin of packing's
    pad) add the per-source sums and counts, ``[2, n_sources]``."""
    if isinstance(output, dict):
        output = output[LANGUAGE]
    mask = loss_mask.to(output.device, torch.float32)
    loss_sum = (output.float() * mask).sum()
    count = mask.sum()
    report = torch.stack([loss_sum.detach(), count.detach()])
    reports = {"loss_sum_and_tokens": report}
    if token_sources is not None and token_sources.numel() == mask.numel():  # (a CP shard: not attributed)
        bins = token_sources
        values = torch.stack([(output.detach().float() * mask).reshape(-1), mask.reshape(-1)]).double()
        per = torch.zeros(2, n_sources + 1, dtype=torch.float64, device=mask.device)
        reports["source_loss_and_tokens"] = per.index_add_(1, bins.to(mask.device), values)[:, :n_sources]
    return loss_sum, count.to(torch.int), reports


def _in_bridge_range(method):
    """``method`` of megatron's communicator, run inside a ``bridge`` range of ``--profile-steps`` traces."""

    @wraps(method)
    def in_range(self, *args, **kwargs):
        with phase("bridge"):
            return method(self, *args, **kwargs)

    return in_range


class _BridgeRanges(MultiModulePipelineCommunicator):
    """megatron's multi-module pipeline communicator, with each send and receive in a ``bridge`` range.

    Why it exists: megatron's 1F1B schedule moves activations and gradients (encoder -> language and
    between language pipeline stages) only through the communicator it is given, with no hook around
    a transfer, so a profile would show the bridge's waits as part of whatever phase is open. The six
    point-to-point methods that schedule calls are megatron's own, each wrapped in the range; nothing
    else differs.
    """

    recv_forward = _in_bridge_range(MultiModulePipelineCommunicator.recv_forward)
    send_forward = _in_bridge_range(MultiModulePipelineCommunicator.send_forward)
    send_forward_recv_backward = _in_bridge_range(MultiModulePipelineCommunicator.send_forward_recv_backward)
    send_backward_recv_forward = _in_bridge_range(MultiModulePipelineCommunicator.send_backward_recv_forward)
    recv_backward = _in_bridge_range(MultiModulePipelineCommunicator.recv_backward)
    send_backward = _in_bridge_range(MultiModulePipelineCommunicator.send_backward)


def name_bridge_groups(communicator, model) -> None:
    """Name the groups megatron's bridges made for themselves, for the hang watchdog's reports
    (``parallel.collectives``): "bridge images->language", its broadcast groups, the colocated gather groups."""
    for bc in getattr(communicator, "bridge_comms", ()):
        pair = f"bridge {bc.src_module_name}->{bc.dest_module_name}"
        name_group(bc.bridge_pg, pair)
        name_group(getattr(bc, "_mimo_shape_pg", None), f"{pair} shapes (host)")
        name_group(bc.src_grid_broadcast_pg, f"{pair} broadcast ({bc.src_module_name} side)")
        name_group(bc.dest_grid_broadcast_pg, f"{pair} broadcast ({bc.dest_module_name} side)")
    for (encoder, language), comm in getattr(model, "colocated_comms", {}).items():
        name_group(getattr(comm, "gather_pg", None), f"bridge {encoder}<->{language} gather")


class StepRunner:
    """Owns the schedule wiring for one run (built once, called every step)."""

    def __init__(self, *, model, modules: dict, pstate, layout, feed: StepFeed, modality_inputs_fn, seq_length: int,
                 local_mbs: int, packing: bool = False):
        self.model = model            # MimoModel with DDP-wrapped submodules
        self.modules = modules        # {module name: DDP-wrapped nn.Module on this rank}
        self.pstate = pstate
        self.feed = feed
        self.modality_inputs_fn = modality_inputs_fn
        self.seq_length = seq_length
        self.local_mbs = local_mbs
        self.packing = packing  # --in-batch-packing: language ranks compute one THD sequence (train.packing)
        self.mine = pstate.mine()
        self.colocated = layout.colocated
        self.bridges = padded_bridges(model)  # colocated fan-in / fan-out only
        cfg = model.config  # the language model's TransformerConfig (on every rank)
        # sequence parallelism splits the packed positions over the language TP ranks: pad to a multiple
        self.pack_multiple = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
        #: language context parallelism (model.context_parallel): the forward step splits every micro-batch
        self.cp = cfg.context_parallel_size
        self.cp_group = pstate.modules[LANGUAGE].pg_collection.cp if self.cp > 1 and LANGUAGE in self.mine else None
        cfg.no_sync_func = self._no_sync
        cfg.finalize_model_grads_func = self._finalize
        cfg.grad_scale_func = None
        self._global_tokens = None
        #: called with each micro-batch (host tensors) before its forward (``train.expert_load``)
        self.micro_batch_hook = None
        #: under context parallelism, called with which of this rank's positions are real tokens (host bool,
        #: local order) before the forward (``train.expert_load``'s load-balancing loss)
        self.split_hook = None
        #: a mixture's source count (0: none): the schedule then also sums loss and tokens per source
        self.n_sources = 0
        self.source_sums = None  # [2, n_sources] of the last schedule (last language stage; device), else None
        if self.colocated:
            self.communicator = None
            self.pg_collection = pstate.modules[LANGUAGE].pg_collection
        else:
            guard_bridge_debug_logging()  # its debug strings would sync on every transfer
            host_bridge_shapes()  # and its shape exchange, per micro-batch: on the host instead
            grids = dict(pstate.grids)
            if grids[LANGUAGE].shape[grids[LANGUAGE].dim_names.index("cp")] > 1:
                # megatron's bridge asserts cp = 1 and needs only the replicas: cp folded into tp
                grids[LANGUAGE] = folded_grid(grids[LANGUAGE])
            self.communicator = _BridgeRanges(
                grids,
                {**{s.name: [LANGUAGE] for s in layout.encoders}, LANGUAGE: []},
                cfg,
                dim_mapping={"s": 0, "h": 2, "b": 1},
                module_output_ndim={s.name: 2 for s in layout.encoders},
            )
            self.pg_collection = MultiModuleProcessGroupCollection(
                module_pgs={n: pstate.modules[n].pg_collection for n in self.mine},
                language_model_module_name=LANGUAGE if LANGUAGE in self.mine else None,
            )
        name_bridge_groups(self.communicator, model)

    # ---- hooks megatron's schedule calls ----------------------------------------------------
    @contextmanager
    def _no_sync(self):
        with ExitStack() as stack:
            for module in self.modules.values():
                stack.enter_context(module.no_sync())
            yield

    def _finalize(self, model_list, num_tokens=None, pg_collection=None, force_all_reduce=False):
        """megatron's gradient finalize per module (with ``--overlap-grad-reduce`` it waits for the
        buckets' reductions started during backward; a vision module first starts, in bucket order,
        those its backward did not: ``parallel.megatron_patches.OrderedGradReduce``), then the global
        token scale."""
        with phase("gradient finalize"):
            total = self.global_tokens()
            for module in self.modules.values():  # all started before any wait
                start_pending_grad_reductions(module, force_all_reduce=force_all_reduce)
            for name, module in self.modules.items():
                pgs = self.pstate.modules[name].pg_collection
                finalize_model_grads([module], num_tokens=None, pg_collection=pgs, force_all_reduce=force_all_reduce)
                sum_partial_grads_over_tp(module, pgs.tp)
                module.scale_gradients(1.0 / max(total, 1.0))

    def global_tokens(self) -> float:
        """Supervised tokens in the whole global batch of this step (identical on every rank)."""
        if self._global_tokens is None:
            name = LANGUAGE if LANGUAGE in self.mine else self.mine[0]
            t = torch.tensor([self.feed.step_loss_tokens()], dtype=torch.float64)
            group = self.pstate.modules[name].dp_gloo
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(t, group=group)
            self._global_tokens = float(t.item())
        return self._global_tokens

    # ---- the forward step ---------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        if self.micro_batch_hook is not None:
            self.micro_batch_hook(batch)
        for bridge in self.bridges:  # per-sample counts, read on the host before the copy
            bridge.prepare(batch)
        has_lang = LANGUAGE in self.mine
        has_enc = any(n != LANGUAGE for n in self.mine)
        packing_kwargs = split = None
        token_sources = None
        if has_lang and self.cp > 1:  # one packed sequence, each cp rank its zigzag share (model.context_parallel)
            batch, packing_kwargs, token_sources, split = self._split_for_cp(batch)
        elif has_lang:
            if self.n_sources and "source_ids" in batch:  # each position's source, as the loss lays them
                src = batch["source_ids"]
                token_sources = (torch.repeat_interleave(src, batch["attention_mask"].sum(dim=1).long())
                                 if self.packing else src[:, None].expand(batch["loss_mask"].shape).reshape(-1))
            if self.packing:  # every language stage packs the same rows the same way
                # cu_seqlens stay on the host: every layer's rotary and attention read them there (no device sync)
                batch, packing_kwargs = pack_micro_batch(batch, multiple=self.pack_multiple)
            if token_sources is not None and token_sources.numel() < batch["loss_mask"].numel():  # the pad segment
                token_sources = torch.cat([token_sources, token_sources.new_full(
                    (batch["loss_mask"].numel() - token_sources.numel(),), self.n_sources)])
        if hasattr(model, "set_context_split"):
            model.set_context_split(split)
        host_grid = batch.get("image_grid_thw")
        if hasattr(model, "set_token_positions"):  # MIMO places the tokens from host indices (model.token_positions)
            model.set_token_positions(TokenPositions.of(batch["input_ids"], model.special_token_ids, runtime.device()))
        batch = runtime.to_device(batch)
        kwargs = {"input_ids": batch["input_ids"]}
        if has_enc:  # the vision tower plans its attention from the host grid (model.vision_attention)
            kwargs["modality_inputs"] = self.modality_inputs_fn(dict(batch, image_grid_thw=host_grid))
        if has_lang:
            # Right padding + causal attention: real tokens never attend to pads, so no padding
            # mask is needed (colocated MIMO passes None anyway); pads are masked in the loss.
            kwargs.update(position_ids=batch["position_ids"], attention_mask=None,
                          loss_mask=batch["loss_mask"], labels=batch["labels"], packing_kwargs=packing_kwargs)
        output, loss_mask = model(**kwargs)
        if loss_mask is None:
            loss_mask = batch["loss_mask"]
        return output, partial(_language_loss, loss_mask, token_sources=token_sources, n_sources=self.n_sources)

    def _split_for_cp(self, batch: dict):
        """``(packed batch, packing_kwargs, token sources of this rank's positions or None, ContextSplit)``: the
        micro-batch as one sequence of documents padded to multiples of 2*cp (``train.packing.pack_documents``;
        cu_seqlens stay on the host) and this rank's share of it, indexes built here on the host."""
        mask = batch["attention_mask"].bool()
        batch, packing_kwargs, rows = pack_documents(batch, cp=self.cp, multiple=self.pack_multiple,
                                                     keep_padding=not self.packing)
        bounds = packing_kwargs["cu_seqlens_q"].tolist()
        split = ContextSplit.build([e - b for b, e in zip(bounds, bounds[1:])], cp=self.cp,
                                   rank=self.cp_group.rank(), group=self.cp_group, device=runtime.device())
        if self.split_hook is not None:
            self.split_hook(real_positions(mask, rows, packing_kwargs["cu_seqlens_q"])[split.local_host])
        token_sources = None
        if self.n_sources and "source_ids" in batch:
            src = batch["source_ids"]
            sources = torch.where(rows >= 0, src[rows.clamp(min=0)], torch.full_like(rows, self.n_sources))
            token_sources = sources[split.local_host]
        return batch, packing_kwargs, token_sources, split

    def run(self, num_microbatches: int) -> StepOutput:
        self._global_tokens = None
        self.feed.start_step()
        for module in self.modules.values():
            module.zero_grad_buffer()
        sums = self._schedule(self.feed, num_microbatches, forward_only=False)
        return StepOutput(sums, self.global_tokens(), self.source_sums)

    def forward_only(self, feed, num_microbatches: int) -> tuple[float, float]:
        """Forward passes of ``num_microbatches`` micro-batches of ``feed`` through the same schedule
        and layout (no backward, no gradient buffers touched, no autograd graph): this rank's
        ``(sum of token losses, supervised tokens)``, non-zero on the last language stage only (read on the
        host, as ``source_sums`` is then: an evaluation reads its result once)."""
        with torch.no_grad():
            sums = self._schedule(feed, num_microbatches, forward_only=True)
        if self.source_sums is not None:
            self.source_sums = self.source_sums.tolist()
        return tuple(sums.tolist()) if sums is not None else (0.0, 0.0)

    def _schedule(self, feed, num_microbatches: int, *, forward_only: bool) -> Optional[torch.Tensor]:
        common = dict(forward_step_func=self._forward_step, data_iterator=feed, model=[self.model],
                      num_microbatches=num_microbatches, seq_length=self.seq_length,
                      micro_batch_size=self.local_mbs, forward_only=forward_only)
        if self.colocated:
            store = schedules.forward_backward_no_pipelining(pg_collection=self.pg_collection, **common)
        else:
            store = schedules.forward_backward_pipelining_without_interleaving(
                p2p_communicator=self.communicator, pg_collection=self.pg_collection, **common)
        reports = [item["loss_sum_and_tokens"] for item in store or []
                   if isinstance(item, dict) and "loss_sum_and_tokens" in item]
        per_source = [item["source_loss_and_tokens"] for item in store or []
                      if isinstance(item, dict) and "source_loss_and_tokens" in item]
        self.source_sums = torch.stack(per_source).double().sum(dim=0) if per_source else None
        if not reports:
            return None
        return torch.stack(reports).double().sum(dim=0)  # stays on the device: no host read per step
