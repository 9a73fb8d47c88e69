"""HF mixture-of-experts MLP weights <-> megatron ``MoELayer`` (``SequentialMLP`` experts), under EP and ETP.

What a Qwen MoE checkpoint holds per sparse layer ``L = <prefix>layers.N.mlp.``:

* the router ``L gate.weight [E, H]`` -> megatron ``mlp.router.weight`` (replicated on every rank);
* the experts, in one of two layouts, told apart by the checkpoint's index (never by the config):

  - **fused**: ``L experts.gate_up_proj`` and ``L experts.down_proj``. transformers 5.23 computes with
    ``[E, 2I, H]`` / ``[E, H, I]`` (gate rows first) but Qwen3-VL-MoE's released files store them
    transposed (``[E, H, 2I]`` / ``[E, I, H]``); transformers' loader transposes unless the stored shape
    already is the computing one (``Transpose(1, 2, check_dims=True)``), and so does :func:`_read_fused`;
  - **per expert**: ``L experts.K.{gate,up,down}_proj.weight`` (``[I, H]``, ``[I, H]``, ``[H, I]``; the
    Qwen2/Qwen3-MoE and Qwen3.5-MoE naming).

Megatron side (megatron-core 0.19.2, ``SequentialMLP``): expert parallel rank ``r`` of ``ep`` holds the
global experts ``r*E/ep .. (r+1)*E/ep - 1`` as ``mlp.experts.local_experts.k`` (``k`` local); each
expert is a gated MLP whose ``linear_fc1`` is [gate; up] and, under expert tensor parallelism, holds
its etp rank's chunk of gate followed by its chunk of up (as the dense ``linear_fc1``), ``linear_fc2``
its column chunk. Loading reads one expert at a time (one ``[H, 2I]`` slice of a fused tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from mimo_sft.model.hf_checkpoint import HFCheckpoint


@dataclass(frozen=True)
class ExpertShape:
    """A sparse layer's sizes: experts, their FFN width, the hidden width; ``shared_ffn``: the FFN width of a
    shared expert every token runs through, scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen3.5-MoE;
    0: none)."""

    experts: int
    ffn: int
    hidden: int
    shared_ffn: int = 0


@dataclass(frozen=True)
class ExpertSlice:
    """Which experts and which part of each this rank holds."""

    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1
    #: the shared expert is split over the module's tp, as a dense MLP
    tp_rank: int = 0
    tp: int = 1

    def experts(self, total: int) -> range:
        n = total // self.ep
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


def moe_layer_indexes(num_layers: int, num_experts: int, *, sparse_step: int = 1, mlp_only=()) -> frozenset:
    """Global indexes of the sparse layers (``config.families.sparse_layer_indexes``, which the memory
    forecast reads too)."""
    from mimo_sft.config.families import sparse_layer_indexes

    return sparse_layer_indexes({"num_hidden_layers": num_layers, "num_experts": num_experts,
                                 "decoder_sparse_step": sparse_step, "mlp_only_layers": list(mlp_only or ())})


def expected_expert_shapes(ckpt: HFCheckpoint, prefix: str, layers, s: ExpertShape) -> dict[str, tuple]:
    """Every MoE tensor the config implies, in the layout the checkpoint stores (its index decides)."""
    out = {}
    for i in sorted(layers):
        L = f"{prefix}layers.{i}.mlp."
        out[L + "gate.weight"] = (s.experts, s.hidden)
        if s.shared_ffn:
            S = L + "shared_expert."
            out.update({S + "gate_proj.weight": (s.shared_ffn, s.hidden), S + "up_proj.weight": (s.shared_ffn, s.hidden),
                        S + "down_proj.weight": (s.hidden, s.shared_ffn), L + "shared_expert_gate.weight": (1, s.hidden)})
        if _fused(ckpt, L):
            gu, dn = ckpt.shape(L + "experts.gate_up_proj"), ckpt.shape(L + "experts.down_proj")
            out[L + "experts.gate_up_proj"] = gu if gu == (s.experts, s.hidden, 2 * s.ffn) else (s.experts, 2 * s.ffn, s.hidden)
            out[L + "experts.down_proj"] = dn if dn == (s.experts, s.ffn, s.hidden) else (s.experts, s.hidden, s.ffn)
        else:
            for e in range(s.experts):
                E = f"{L}experts.{e}."
                out.update({E + "gate_proj.weight": (s.ffn, s.hidden), E + "up_proj.weight": (s.ffn, s.hidden),
                            E + "down_proj.weight": (s.hidden, s.ffn)})
    return out


def _fused(ckpt: HFCheckpoint, L: str) -> bool:
    return ckpt.has(L + "experts.gate_up_proj")


def _read_fused(ckpt: HFCheckpoint, L: str, e: int, s: ExpertShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s ``[2I, H]`` gate_up and ``[H, I]`` down from the fused tensors, whichever way stored."""
    gu = ckpt.read(L + "experts.gate_up_proj", rows=(e, e + 1))[0]
    dn = ckpt.read(L + "experts.down_proj", rows=(e, e + 1))[0]
    if tuple(gu.shape) != (2 * s.ffn, s.hidden):
        gu = gu.t()
    if tuple(dn.shape) != (s.hidden, s.ffn):
        dn = dn.t()
    return gu, dn


def read_expert_layer(ckpt: HFCheckpoint, prefix: str, layer: int, local_layer: int, s: ExpertShape,
                      where: ExpertSlice) -> dict[str, torch.Tensor]:
    """One sparse layer's router and this rank's experts, megatron-named (``decoder.layers.<local>.mlp.``)."""
    L = f"{prefix}layers.{layer}.mlp."
    M = f"decoder.layers.{local_layer}.mlp."
    out = {M + "router.weight": ckpt.read(L + "gate.weight")}
    n = s.ffn // where.etp
    lo, hi = where.etp_rank * n, (where.etp_rank + 1) * n
    fused = _fused(ckpt, L)
    for k, e in enumerate(where.experts(s.experts)):
        if fused:
            gu, dn = _read_fused(ckpt, L, e, s)
            gate, up = gu[lo:hi], gu[s.ffn + lo:s.ffn + hi]
            down = dn[:, lo:hi]
        else:
            E = f"{L}experts.{e}."
            gate = ckpt.read(E + "gate_proj.weight", rows=(lo, hi))
            up = ckpt.read(E + "up_proj.weight", rows=(lo, hi))
            down = ckpt.read(E + "down_proj.weight", rows=(0, s.hidden), cols=(lo, hi))
        X = f"{M}experts.local_experts.{k}."
        out[X + "linear_fc1.weight"] = torch.cat([gate, up], dim=0).contiguous()
        out[X + "linear_fc2.weight"] = down.contiguous()
    if s.shared_ffn:  # megatron's SharedExpertMLP: a tp-split gated MLP and its [1, h] gate
        S, n = L + "shared_expert.", s.shared_ffn // where.tp
        rows = (where.tp_rank * n, (where.tp_rank + 1) * n)
        out[M + "shared_experts.linear_fc1.weight"] = torch.cat(
            [ckpt.read(S + "gate_proj.weight", rows=rows), ckpt.read(S + "up_proj.weight", rows=rows)], dim=0)
        out[M + "shared_experts.linear_fc2.weight"] = ckpt.read(S + "down_proj.weight", rows=(0, s.hidden), cols=rows)
        out[M + "shared_experts.gate_weight"] = ckpt.read(L + "shared_expert_gate.weight")
    return out


def with_experts(groups: Iterator[dict], ckpt: HFCheckpoint, prefix: str, *, layer_offset: int, moe_layers,
                 s: ExpertShape, where: ExpertSlice) -> Iterator[dict]:
    """The dense reader's groups (``decoder_weights.iter_decoder_shard``) with each sparse layer's
    router and experts added to its layer's group, so loading stays one layer at a time."""
    for group in groups:
        local = {int(k.split(".")[2]) for k in group if k.startswith("decoder.layers.")}
        for j in local:
            if layer_offset + j in moe_layers:
                group.update(read_expert_layer(ckpt, prefix, layer_offset + j, j, s, where))
        yield group


def export_experts(sd: dict[str, torch.Tensor], prefix: str, moe_layers, s: ExpertShape, *,
                   fused: bool = True) -> dict[str, torch.Tensor]:
    """TP=EP=1 megatron MoE tensors -> HF tensors: ``fused`` writes what transformers' own ``save_pretrained``
    writes (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; transformers reads it back unchanged, and
    released files' transposed tensors too), else one tensor per expert. Works on any part of the state
    made of whole layers (the streamed export)."""
    out = {}
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")})
    for i in layers:
        if i not in moe_layers:
            continue
        M, L = f"decoder.layers.{i}.mlp.", f"{prefix}layers.{i}.mlp."
        out[L + "gate.weight"] = sd[M + "router.weight"]
        if s.shared_ffn:
            gate, up = torch.split(sd[M + "shared_experts.linear_fc1.weight"], [s.shared_ffn, s.shared_ffn], dim=0)
            out.update({L + "shared_expert.gate_proj.weight": gate, L + "shared_expert.up_proj.weight": up,
                        L + "shared_expert.down_proj.weight": sd[M + "shared_experts.linear_fc2.weight"],
                        L + "shared_expert_gate.weight": sd[M + "shared_experts.gate_weight"]})
        fc1 = [sd[f"{M}experts.local_experts.{e}.linear_fc1.weight"] for e in range(s.experts)]
        fc2 = [sd[f"{M}experts.local_experts.{e}.linear_fc2.weight"] for e in range(s.experts)]
        if fused:
            out[L + "experts.gate_up_proj"] = torch.stack(fc1)
            out[L + "experts.down_proj"] = torch.stack(fc2)
        else:
            for e in range(s.experts):
                gate, up = torch.split(fc1[e], [s.ffn, s.ffn], dim=0)
                E = f"{L}experts.{e}."
                out.update({E + "gate_proj.weight": gate.contiguous(), E + "up_proj.weight": up.contiguous(),
                            E + "down_proj.weight": fc2[e]})
    return out
