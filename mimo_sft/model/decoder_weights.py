"""HF decoder-only language weights <-> megatron ``GPTModel`` (local spec) weights, under TP and PP.

Written for the Qwen2 / Qwen2.5 / Qwen3 decoder naming that Qwen-VL checkpoints share
(``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.mlp.{gate,up,down}_proj``, RMSNorms), so a new
family only describes its prefixes and options in a ``DecoderNames``.

Layout rules (megatron-core 0.19.2, checked against transformers by the parity tests):

* ``linear_qkv`` is grouped per KV head: for each query group, that group's q heads, then its k head,
  then its v head (weights and biases alike). A plain [Q;K;V] concatenation is only right with one
  KV head. Under TP each rank holds ``num_kv_heads / tp`` whole groups.
* ``linear_fc1`` is [gate; up]; under TP each rank holds its chunk of gate followed by its chunk of
  up (not a contiguous slice of the fused tensor).
* ``linear_proj`` and ``linear_fc2`` split by columns; embeddings and ``output_layer`` by rows
  (vocab padded to a multiple of TP with zero rows); norms are replicated.
* Tied embeddings: no ``output_layer.weight`` (``share_embeddings_and_output_weights=True``).

Loading reads only this rank's rows/columns from the safetensors shards (``HFCheckpoint.read``),
one decoder layer at a time (:func:`iter_decoder_shard`): :func:`copy_into` copies each layer into
the model before the next is read, so host memory holds one layer's slice, not the rank's stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from mimo_sft.model.hf_checkpoint import HFCheckpoint


@dataclass(frozen=True)
class DecoderNames:
    """Where a family keeps its decoder tensors and which optional tensors it has."""

    prefix: str  # e.g. "model." or "model.language_model."
    lm_head: str = "lm_head.weight"
    qkv_bias: bool = True
    qk_norm: bool = False  # Qwen3: self_attn.q_norm / k_norm


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    padded_vocab: int
    tied: bool
    #: global indexes of mixture-of-experts layers: their MLP tensors are not the dense gate/up/down
    #: (``model.moe_weights`` reads and writes those layers' router and experts)
    moe_layers: frozenset = frozenset()


def pad_vocab(vocab: int, tp: int) -> int:
    return ((vocab + tp - 1) // tp) * tp


# ---- pure layout helpers (used both ways, tested on their own) --------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[Q; K; V] rows (for ``groups`` query groups) -> megatron's per-group [q..., k, v] rows."""
    rest = q.shape[1:]
    qg = q.reshape(groups, -1, *rest)
    kg = k.reshape(groups, -1, *rest)
    vg = v.reshape(groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, groups: int, head_dim: int, heads_per_group: int):
    """Inverse of :func:`fuse_qkv`: megatron's grouped rows -> (q, k, v)."""
    rest = fused.shape[1:]
    g = fused.reshape(groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(g, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def _span(total: int, rank: int, tp: int) -> tuple[int, int]:
    n = total // tp
    return rank * n, (rank + 1) * n


# ---- HF -> megatron ---------------------------------------------------------------------------
def expected_hf_shapes(names: DecoderNames, s: DecoderShape) -> dict[str, tuple]:
    """Every HF tensor the config implies, with its shape (used to check the weights first)."""
    p = names.prefix
    out = {f"{p}embed_tokens.weight": (s.vocab, s.hidden), f"{p}norm.weight": (s.hidden,)}
    if not s.tied:
        out[names.lm_head] = (s.vocab, s.hidden)
    for i in range(s.num_layers):
        L = f"{p}layers.{i}."
        out.update({
            L + "input_layernorm.weight": (s.hidden,),
            L + "post_attention_layernorm.weight": (s.hidden,),
            L + "self_attn.q_proj.weight": (s.heads * s.head_dim, s.hidden),
            L + "self_attn.k_proj.weight": (s.kv_heads * s.head_dim, s.hidden),
            L + "self_attn.v_proj.weight": (s.kv_heads * s.head_dim, s.hidden),
            L + "self_attn.o_proj.weight": (s.hidden, s.heads * s.head_dim),
        })
        if i not in s.moe_layers:
            out.update({L + "mlp.gate_proj.weight": (s.ffn, s.hidden), L + "mlp.up_proj.weight": (s.ffn, s.hidden),
                        L + "mlp.down_proj.weight": (s.hidden, s.ffn)})
        if names.qkv_bias:
            out.update({L + "self_attn.q_proj.bias": (s.heads * s.head_dim,),
                        L + "self_attn.k_proj.bias": (s.kv_heads * s.head_dim,),
                        L + "self_attn.v_proj.bias": (s.kv_heads * s.head_dim,)})
        if names.qk_norm:
            out.update({L + "self_attn.q_norm.weight": (s.head_dim,), L + "self_attn.k_norm.weight": (s.head_dim,)})
    return out


def _vocab_rows(ckpt: HFCheckpoint, name: str, s: DecoderShape, rank: int, tp: int) -> torch.Tensor:
    r0, r1 = _span(s.padded_vocab, rank, tp)
    real = ckpt.read(name, rows=(min(r0, s.vocab), min(r1, s.vocab)))
    if real.shape[0] == r1 - r0:
        return real
    pad = torch.zeros(r1 - r0 - real.shape[0], s.hidden, dtype=real.dtype)
    return torch.cat([real, pad], dim=0)


def load_decoder_shard(ckpt: HFCheckpoint, names: DecoderNames, s: DecoderShape, **where) -> dict[str, torch.Tensor]:
    """This rank's megatron ``GPTModel`` state as one dict (:func:`iter_decoder_shard`'s groups merged)."""
    out: dict[str, torch.Tensor] = {}
    for group in iter_decoder_shard(ckpt, names, s, **where):
        out.update(group)
    return out


def iter_decoder_shard(ckpt: HFCheckpoint, names: DecoderNames, s: DecoderShape, *, tp_rank: int, tp: int,
                       layer_offset: int, num_local_layers: int, pre_process: bool, post_process: bool
                       ) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's megatron ``GPTModel`` state (names without the ``language_model.`` prefix), read
    lazily in groups: embeddings / final norm / output layer, then one decoder layer at a time."""
    p = names.prefix
    out: dict[str, torch.Tensor] = {}
    if pre_process:
        out["embedding.word_embeddings.weight"] = _vocab_rows(ckpt, f"{p}embed_tokens.weight", s, tp_rank, tp)
    if post_process:
        out["decoder.final_layernorm.weight"] = ckpt.read(f"{p}norm.weight")
        if not s.tied:
            out["output_layer.weight"] = _vocab_rows(ckpt, names.lm_head, s, tp_rank, tp)
        elif not pre_process:  # tied and PP > 1: the last stage keeps its own copy of the embedding
            out["output_layer.weight"] = _vocab_rows(ckpt, f"{p}embed_tokens.weight", s, tp_rank, tp)
    yield out
    groups_local = s.kv_heads // tp
    q_rows = _span(s.heads * s.head_dim, tp_rank, tp)
    kv_rows = _span(s.kv_heads * s.head_dim, tp_rank, tp)
    ffn_rows = _span(s.ffn, tp_rank, tp)
    for j in range(num_local_layers):
        L = f"{p}layers.{layer_offset + j}."
        M = f"decoder.layers.{j}."
        out = {}
        q = ckpt.read(L + "self_attn.q_proj.weight", rows=q_rows)
        k = ckpt.read(L + "self_attn.k_proj.weight", rows=kv_rows)
        v = ckpt.read(L + "self_attn.v_proj.weight", rows=kv_rows)
        out[M + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, groups_local)
        if names.qkv_bias:
            qb = ckpt.read(L + "self_attn.q_proj.bias", rows=q_rows)
            kb = ckpt.read(L + "self_attn.k_proj.bias", rows=kv_rows)
            vb = ckpt.read(L + "self_attn.v_proj.bias", rows=kv_rows)
            out[M + "self_attention.linear_qkv.bias"] = fuse_qkv(qb, kb, vb, groups_local)
        if names.qk_norm:
            out[M + "self_attention.q_layernorm.weight"] = ckpt.read(L + "self_attn.q_norm.weight")
            out[M + "self_attention.k_layernorm.weight"] = ckpt.read(L + "self_attn.k_norm.weight")
        out[M + "self_attention.linear_proj.weight"] = ckpt.read(L + "self_attn.o_proj.weight", rows=(0, s.hidden), cols=q_rows)
        out[M + "input_layernorm.weight"] = ckpt.read(L + "input_layernorm.weight")
        out[M + "pre_mlp_layernorm.weight"] = ckpt.read(L + "post_attention_layernorm.weight")
        if layer_offset + j not in s.moe_layers:
            gate = ckpt.read(L + "mlp.gate_proj.weight", rows=ffn_rows)
            up = ckpt.read(L + "mlp.up_proj.weight", rows=ffn_rows)
            out[M + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[M + "mlp.linear_fc2.weight"] = ckpt.read(L + "mlp.down_proj.weight", rows=(0, s.hidden), cols=ffn_rows)
        yield out


# ---- megatron (TP=1) -> HF ----------------------------------------------------------------------
def export_decoder(sd: dict[str, torch.Tensor], names: DecoderNames, s: DecoderShape) -> dict[str, torch.Tensor]:
    """TP=1 ``GPTModel`` tensors (no prefix) -> HF tensors (exact copies, vocab padding removed).

    ``sd`` may be any part of the state made of whole decoder layers and single edge tensors
    (embedding, final norm, output layer): the streamed export converts one such group at a time.
    """
    p = names.prefix
    out = {}
    if "embedding.word_embeddings.weight" in sd:
        out[f"{p}embed_tokens.weight"] = sd["embedding.word_embeddings.weight"][: s.vocab]
    if "decoder.final_layernorm.weight" in sd:
        out[f"{p}norm.weight"] = sd["decoder.final_layernorm.weight"]
    if "output_layer.weight" in sd and not s.tied:
        out[names.lm_head] = sd["output_layer.weight"][: s.vocab]
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")})
    for i in layers:
        out.update(_export_layer(sd, names, s, i))
    return {k: v.contiguous() for k, v in out.items()}


def _export_layer(sd: dict[str, torch.Tensor], names: DecoderNames, s: DecoderShape, i: int) -> dict[str, torch.Tensor]:
    L = f"{names.prefix}layers.{i}."
    M = f"decoder.layers.{i}."
    hpg = s.heads // s.kv_heads
    out = {}
    q, k, v = split_qkv(sd[M + "self_attention.linear_qkv.weight"], s.kv_heads, s.head_dim, hpg)
    out.update({L + "self_attn.q_proj.weight": q, L + "self_attn.k_proj.weight": k, L + "self_attn.v_proj.weight": v})
    if names.qkv_bias:
        qb, kb, vb = split_qkv(sd[M + "self_attention.linear_qkv.bias"], s.kv_heads, s.head_dim, hpg)
        out.update({L + "self_attn.q_proj.bias": qb, L + "self_attn.k_proj.bias": kb, L + "self_attn.v_proj.bias": vb})
    if names.qk_norm:
        out[L + "self_attn.q_norm.weight"] = sd[M + "self_attention.q_layernorm.weight"]
        out[L + "self_attn.k_norm.weight"] = sd[M + "self_attention.k_layernorm.weight"]
    out[L + "self_attn.o_proj.weight"] = sd[M + "self_attention.linear_proj.weight"]
    out[L + "input_layernorm.weight"] = sd[M + "input_layernorm.weight"]
    out[L + "post_attention_layernorm.weight"] = sd[M + "pre_mlp_layernorm.weight"]
    if i not in s.moe_layers:
        gate, up = torch.split(sd[M + "mlp.linear_fc1.weight"], [s.ffn, s.ffn], dim=0)
        out[L + "mlp.gate_proj.weight"] = gate
        out[L + "mlp.up_proj.weight"] = up
        out[L + "mlp.down_proj.weight"] = sd[M + "mlp.linear_fc2.weight"]
    return out


def copy_into(module: torch.nn.Module, tensors: Union[dict[str, torch.Tensor], Iterable[dict[str, torch.Tensor]]],
              *, where: str, skip: Optional[Callable[[str], bool]] = None) -> None:
    """Copy ``tensors`` (a dict, or groups of them read one at a time: each group is copied and
    dropped before the next is read) into ``module``'s parameters; every parameter must be covered
    exactly once."""
    params = {k: v for k, v in module.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    if skip is not None:
        params = {k: v for k, v in params.items() if not skip(k)}
    covered: set[str] = set()
    with torch.no_grad():
        for group in ([tensors] if isinstance(tensors, dict) else tensors):
            extra = sorted(set(group) - set(params) | (set(group) & covered))
            assert not extra, f"{where}: weight mapping mismatch: unexpected or repeated {extra[:5]}"
            for name, src in group.items():
                target = params[name]
                assert tuple(src.shape) == tuple(target.shape), f"{where}: {name} {tuple(src.shape)} != {tuple(target.shape)}"
                target.copy_(src.to(target.dtype))
            covered |= set(group)
            del group
    missing = sorted(set(params) - covered)
    assert not missing, f"{where}: weight mapping mismatch: missing {missing[:5]}"
