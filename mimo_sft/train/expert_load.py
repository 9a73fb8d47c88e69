"""A mixture-of-experts step's routing: tokens per expert per layer, and the optional load-balancing loss.

**Figures.** A router that collapses onto a few experts trains silently worse (and, under expert
parallelism, makes one rank the straggler of every all-to-all). Each decoder layer's ``TopKRouter``
returns its routing map (tokens x experts, top-k ones per token); a forward hook adds its column sums
into one device tensor ``[layers, experts]`` per step -- no host sync inside the step. After the step
every rank joins one all-reduce on the world's gloo group (the layers of other pipeline stages and the
other data-parallel ranks' tokens; encoder-only ranks add zeros), so the metrics rank sees every layer.
Without sequence parallelism the tp ranks of a stage route the same tokens, so their sum is divided by
tp; with it each routes its own slice. Padding positions are routed (and computed) too, so they count.
Only a training forward that builds the graph counts (under full recomputation, the recomputed one).

``metrics.jsonl`` / TensorBoard ``train/``: ``moe_load_max_over_mean`` (the worst layer's most loaded
expert over the mean; 1 is perfect balance, ``experts / top_k`` total collapse),
``moe_load_max_over_mean_layer_<i>``, and with the loss on ``moe_aux_loss``. No token is dropped (no
capacity factor: megatron's dropless routing), so there is no dropped-token count.

**The load-balancing loss** (``--moe-aux-loss-coeff`` c > 0; off by default, as transformers trains
these models: its own ``router_aux_loss_coef`` applies only with ``output_router_logits``, to a loss
over all layers jointly, so neither coefficient is the other's). Per sparse layer and micro-batch, on
each rank's real tokens (padding excluded), the Switch loss ``aux = E * sum_e f_e * P_e`` (``f_e``: share of the top-k slots
routed to expert e, ``P_e``: mean softmax probability of e; 1 at perfect balance), computed here from
the router's own logits. The training objective is ``(sum of token losses + c * sum_mb S_mb * sum_layers
aux) / S``, ``S_mb`` the micro-batch's supervised tokens on the rank and ``S`` the step's: the aux loss
is averaged over micro-batches weighted by their supervised tokens, consistently with mimo-sft's
per-token loss normalisation (``train.step``), on any layout. Why not megatron's own: under
``calculate_per_token_loss`` megatron scales the aux gradient for a loss divided by every token
position, so with mimo-sft's division by supervised tokens it would weigh positions / supervised
tokens times more (26x on the tests' data). Each micro-batch's weight is captured at its forward (the
autograd node keeps it), so pipeline schedules with several micro-batches in flight stay exact; a
recomputed MoE layer would read a later micro-batch's weight, so check 21 refuses recomputation with
the loss on. Where one sequence is spread over ranks -- sequence-parallel tp slices, context-parallel
shares, or both -- the loss is still the whole sequence's: the slot counts, probability sums and token
counts are added over those ranks (one all-reduce per layer and micro-batch), and each rank's part, whose
parts add up to the loss, carries its own tokens' gradient (:func:`cp_aux_loss`; megatron sums the router's
gradient over dp x cp and, for sequence parallelism, over tp).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mimo_sft.parallel.runtime import host_to


class _AttachAux(torch.autograd.Function):
    """Returns ``output`` unchanged; in backward adds ``weight`` * d(aux) to the graph (``aux``'s gradient
    is the constant ``weight``, kept on this node)."""

    @staticmethod
    def forward(ctx, output, aux, weight: float):
        ctx.weight = weight
        ctx.aux_shape = aux.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.full(ctx.aux_shape, ctx.weight, dtype=torch.float32, device=grad_output.device), None


def switch_aux_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over these tokens (fp32 ``[tokens, E]`` logits; ``switch_aux_parts``' sums, with
    torch's mean for ``P_e``: the rounding the single-process runs have always had)."""
    probs = torch.softmax(logits.float(), dim=-1)
    slots, _ = switch_aux_parts(logits, topk, probs=probs)
    return probs.shape[-1] * (slots / max(logits.shape[0] * topk, 1) * probs.mean(dim=0)).sum()


def switch_aux_parts(logits: torch.Tensor, topk: int, *, probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top-k slots per expert [E], summed softmax probability per expert [E])`` of these tokens: the two sums
    the Switch loss is made of, so that ranks holding parts of one sequence can add them up (context
    parallelism). The probabilities carry the graph; the slot counts none."""
    probs = torch.softmax(logits.float(), dim=-1) if probs is None else probs
    experts = probs.shape[-1]
    chosen = torch.topk(logits.float(), topk, dim=-1).indices
    slots = torch.zeros(experts, dtype=torch.float32, device=logits.device).index_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), dtype=torch.float32, device=logits.device))
    return slots, probs.sum(dim=0)


def cp_aux_loss(logits: torch.Tensor, topk: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(this rank's differentiable part, the sequence's Switch loss value)`` when the sequence's tokens are
    spread over the ranks of ``group`` (context parallelism): the slot counts, token count and probability sums
    are summed over the group (one all-reduce; the value only), and each rank's part is
    ``E * sum_e f_e * P_e(own tokens) / N``, so the parts add up to the loss of the whole sequence and each rank's
    gradient is the one-process gradient of its own tokens."""
    slots, prob_sum = switch_aux_parts(logits, topk)
    experts = slots.shape[0]
    both = torch.cat([slots, prob_sum.detach(), slots.new_full((1,), float(logits.shape[0]))])
    dist.all_reduce(both, group=group)
    total_slots, total_probs, tokens = both[:experts], both[experts:2 * experts], both[2 * experts:].clamp(min=1.0)
    share = total_slots / (tokens * topk)
    part = experts * (share * prob_sum / tokens).sum()
    value = experts * (share * total_probs / tokens).sum()
    return part, value


class ExpertLoad:
    """Counts tokens per expert for this rank's MoE layers; attaches the load-balancing loss when on."""

    def __init__(self, language_model, *, num_layers: int, num_experts: int, topk: int, tp: int,
                 sequence_parallel: bool, aux_coeff: float = 0.0, tp_rank: int = 0, seq_group=None):
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.duplicates = 1 if sequence_parallel else tp
        #: sequence-parallel tp ranks each hold a slice of the positions (``_real_rows`` picks this rank's)
        self.aux_share = tp if sequence_parallel else 1
        self.aux_coeff = aux_coeff
        self.tp_rank = tp_rank
        self._attention = None
        #: supervised tokens of the micro-batch now running forward on this rank (``train.step`` sets it)
        self.micro_batch_tokens = 0.0
        #: the ranks a micro-batch's sequence is spread over (sequence-parallel tp, cp, or both): the loss's sums
        #: are added over them (:func:`cp_aux_loss`); None: each rank holds whole sequences
        self._seq_group = seq_group
        #: under context parallelism: which of this rank's positions are real tokens (host; ``see_cp``)
        self._cp_real: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self.aux_sum: Optional[torch.Tensor] = None
        self.records = [0] * num_layers
        self._hooks = []
        if language_model is None:
            return
        from megatron.core.transformer.moe.router import TopKRouter

        for layer in language_model.decoder.layers:
            mlp = getattr(layer, "mlp", None)
            if isinstance(getattr(mlp, "router", None), TopKRouter):
                index = layer.layer_number - 1
                self._hooks.append(mlp.router.register_forward_hook(self._count(index)))
                if aux_coeff > 0:
                    self._hooks.append(mlp.register_forward_hook(self._attach(index)))

    def see(self, batch: dict) -> None:
        """``train.step``'s micro-batch hook: the supervised tokens of the micro-batch about to run forward, and
        which of its positions are real tokens (the rows are right-padded; packing keeps the real ones first)."""
        mask = batch.get("loss_mask")
        self.micro_batch_tokens = float(mask.sum()) if mask is not None else 0.0
        self._attention = batch.get("attention_mask")

    def see_cp(self, real: torch.Tensor) -> None:
        """``train.step``'s split hook under context parallelism: this rank's positions that are real tokens (host
        bool, in its local order)."""
        self._cp_real = real

    def _real_rows(self, local_rows: int) -> torch.Tensor:
        """Which of the MoE layer's ``local_rows`` input rows are real tokens: the padded ``[S, B]`` order
        (megatron's sequence-first layout), or packed (real tokens first, then the tp-multiple padding),
        and under sequence parallelism this tp rank's slice of them."""
        full = local_rows * self.aux_share
        attention = self._attention
        if self._cp_real is not None:
            assert self._cp_real.numel() == full, (self._cp_real.numel(), full)
            real = self._cp_real
        elif attention is None:
            real = torch.ones(full, dtype=torch.bool)
        elif attention.numel() == full:
            real = attention.bool().t().reshape(-1)
        else:
            real = torch.arange(full) < int(attention.sum())
        return real[self.tp_rank * local_rows:(self.tp_rank + 1) * local_rows] if self.aux_share > 1 else real

    @staticmethod
    def _counted(module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _count(self, index: int):
        def count(module, inputs, output):
            if not self._counted(module):
                return
            routing_map = output[1]
            if self.counts is None:
                self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float32,
                                          device=routing_map.device)
            self.counts[index] += routing_map.sum(dim=0, dtype=torch.float32)
        return count

    def _attach(self, index: int):
        def attach(module, inputs, output):
            if not self._counted(module):
                return None
            hidden = inputs[0]
            rows = hidden.reshape(-1, hidden.shape[-1])
            real = self._real_rows(rows.shape[0])  # on the host: which rows are tokens is known there
            spread = self._seq_group
            if not bool(real.any()) and spread is None:
                return None  # no real token here (a rank of a spread sequence joins the sums anyway)
            picked = host_to(real.nonzero().reshape(-1), rows.device)  # one copy; no mask index (a device read)
            logits = torch.nn.functional.linear(rows.index_select(0, picked).float(), module.router.weight.float())
            if spread is None:
                aux = value = switch_aux_loss(logits, self.topk)
            else:  # the sequence's loss from the group's sums; this rank's part carries its own tokens' gradient
                aux, value = cp_aux_loss(logits, self.topk, spread)
            if self.aux_sum is None:
                self.aux_sum = torch.zeros(self.num_layers, dtype=torch.float64, device=aux.device)
            self.aux_sum[index] += value.detach().double()
            self.records[index] += 1
            weight = self.aux_coeff * self.micro_batch_tokens  # the parts add up to the sequence's loss
            out, bias = output if isinstance(output, tuple) else (output, None)
            out = _AttachAux.apply(out, aux, weight)
            return (out, bias) if isinstance(output, tuple) else out
        return attach

    def step_figures(self, group) -> dict:
        """The step's figures on every rank (collective over ``group``: every rank of the world), then reset."""
        n, e = self.num_layers, self.num_experts
        counts = self.counts.cpu().double() if self.counts is not None else torch.zeros(n, e, dtype=torch.float64)
        aux = torch.zeros(2, n, dtype=torch.float64)
        if self.aux_sum is not None:
            aux[0] = self.aux_sum.cpu()
            aux[1] = torch.tensor(self.records, dtype=torch.float64)
        packed = torch.cat([counts.flatten(), aux.flatten()])
        dist.all_reduce(packed, group=group)
        counts = packed[: n * e].view(n, e) / self.duplicates
        self.counts, self.aux_sum, self.records = None, None, [0] * n
        mean = counts.mean(dim=1)
        sparse = [i for i in range(n) if mean[i] > 0]
        out = {}
        if sparse:
            ratios = {i: float(counts[i].max() / mean[i]) for i in sparse}
            out["moe_load_max_over_mean"] = max(ratios.values())
            out.update({f"moe_load_max_over_mean_layer_{i}": r for i, r in ratios.items()})
        if self.aux_coeff > 0 and sparse:
            total, records = packed[n * e: n * e + n], packed[n * e + n:]
            out["moe_aux_loss"] = float(sum(total[i] / max(float(records[i]), 1.0) for i in sparse) / len(sparse))
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def expert_load_for(cfg, ctx, layout) -> Optional[ExpertLoad]:
    """The run's :class:`ExpertLoad` (on every rank: its figures are collective), or None for a dense model."""
    lang_cfg = ctx.info.language_config
    experts = getattr(lang_cfg, "num_moe_experts", None)
    if not experts:
        return None
    lm = ctx.model.language_model
    sp = bool(lang_cfg.sequence_parallel) and layout.language.tp > 1
    return ExpertLoad(getattr(lm, "module", lm), num_layers=lang_cfg.num_layers, num_experts=experts,
                      topk=lang_cfg.moe_router_topk, tp=layout.language.tp,
                      sequence_parallel=bool(lang_cfg.sequence_parallel),
                      aux_coeff=float(cfg.model.moe_aux_loss_coeff or 0.0),
                      tp_rank=lm_tp_rank(ctx, layout), seq_group=_sequence_group(ctx, sp, layout.language.cp))


def _sequence_group(ctx, sp: bool, cp: int):
    """The ranks one micro-batch's sequence is spread over on this rank's language stage: sequence-parallel tp,
    cp, or both (None: whole sequences on each rank, or no language model here)."""
    from mimo_sft.parallel.layout import LANGUAGE

    groups = ctx.pstate.modules.get(LANGUAGE)
    if groups is None or not groups.member:
        return None
    pgs = groups.pg_collection
    return pgs.tp_cp if sp and cp > 1 else pgs.tp if sp else pgs.cp if cp > 1 else None


def lm_tp_rank(ctx, layout) -> int:
    """This rank's language tp rank (0 where it holds no language model)."""
    coord = layout.coords(dist.get_rank()).get("language")
    return coord.tp if coord is not None else 0
