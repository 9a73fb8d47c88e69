"""Qwen3.5's hybrid decoder weights: HF <-> megatron, under TP and PP.

A Qwen3.5 decoder layer is a Gated DeltaNet layer (``layer_types[N] == "linear_attention"``) or a
gated full-attention layer; both have Qwen's gated SiLU MLP and two zero-centred RMSNorms, whose
weights convert as they are. Layout rules (megatron-core 0.19.2's ``GatedDeltaNet`` and
``SelfAttention(attention_output_gate=True)``, checked against transformers by the parity tests):

* GDN ``in_proj`` (one ColumnParallelLinear) holds, on TP rank ``r``, rank ``r``'s chunk of q, of
  k, of v (the three row blocks of HF's ``in_proj_qkv``), then of ``in_proj_z``, ``in_proj_b`` and
  ``in_proj_a``: ``[q_r; k_r; v_r; z_r; b_r; a_r]`` -- not a contiguous slice of the HF rows.
* GDN ``conv1d.weight`` ``[channels, 1, kernel]`` covers ``[q | k | v]`` channels: rank ``r`` holds
  ``[q_r; k_r; v_r]``. ``A_log`` and ``dt_bias`` split by value head; ``out_proj`` by columns; the
  output norm (one value head wide) is replicated.
* Gated attention: HF's ``q_proj`` rows are per head ``[q_h; gate_h]``; megatron's ``linear_qkv``
  is grouped per KV head as ``[q heads of the group; their gate heads; k; v]``.
* The HF key/value heads are consecutive per key head (transformers and megatron both
  ``repeat_interleave`` the key heads), so splitting value heads by rank keeps each rank's value
  heads with its own key heads.

Loading reads one layer at a time and only this rank's rows (as ``decoder_weights`` does).
``mtp.*`` tensors (multi-token prediction, which transformers ignores) are not trained; export
copies them from the source folder so that HF -> mimo -> HF stays bit-exact (``model.export``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from mimo_sft.model.decoder_weights import DecoderShape, _span, _vocab_rows
from mimo_sft.model.hf_checkpoint import HFCheckpoint

LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class HybridShape:
    """The sizes the conversion needs: the decoder's, the layer pattern and the GDN heads."""

    base: DecoderShape
    layer_types: tuple[str, ...]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def qk(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def v(self) -> int:
        return self.value_heads * self.value_dim


def hybrid_shape(text_config, base: DecoderShape) -> HybridShape:
    t = text_config
    return HybridShape(base=base, layer_types=tuple(t.layer_types), key_heads=t.linear_num_key_heads,
                       value_heads=t.linear_num_value_heads, key_dim=t.linear_key_head_dim,
                       value_dim=t.linear_value_head_dim, conv_kernel=t.linear_conv_kernel_dim)


# ---- expected HF tensors ------------------------------------------------------------------------
def expected_layer_shapes(prefix: str, s: HybridShape, i: int) -> dict[str, tuple]:
    b = s.base
    L = f"{prefix}layers.{i}."
    out = {L + "input_layernorm.weight": (b.hidden,), L + "post_attention_layernorm.weight": (b.hidden,)}
    if i not in b.moe_layers:  # a sparse layer's MLP: model.moe_weights
        out.update({L + "mlp.gate_proj.weight": (b.ffn, b.hidden), L + "mlp.up_proj.weight": (b.ffn, b.hidden),
                    L + "mlp.down_proj.weight": (b.hidden, b.ffn)})
    if s.layer_types[i] == LINEAR:
        A = L + "linear_attn."
        out.update({A + "in_proj_qkv.weight": (2 * s.qk + s.v, b.hidden), A + "in_proj_z.weight": (s.v, b.hidden),
                    A + "in_proj_b.weight": (s.value_heads, b.hidden), A + "in_proj_a.weight": (s.value_heads, b.hidden),
                    A + "conv1d.weight": (2 * s.qk + s.v, 1, s.conv_kernel), A + "A_log": (s.value_heads,),
                    A + "dt_bias": (s.value_heads,), A + "norm.weight": (s.value_dim,),
                    A + "out_proj.weight": (b.hidden, s.v)})
    else:
        A = L + "self_attn."
        q, kv = b.heads * b.head_dim, b.kv_heads * b.head_dim
        out.update({A + "q_proj.weight": (2 * q, b.hidden), A + "k_proj.weight": (kv, b.hidden),
                    A + "v_proj.weight": (kv, b.hidden), A + "o_proj.weight": (b.hidden, q),
                    A + "q_norm.weight": (b.head_dim,), A + "k_norm.weight": (b.head_dim,)})
    return out


def expected_hf_shapes(prefix: str, lm_head: str, s: HybridShape) -> dict[str, tuple]:
    b = s.base
    out = {f"{prefix}embed_tokens.weight": (b.vocab, b.hidden), f"{prefix}norm.weight": (b.hidden,)}
    if not b.tied:
        out[lm_head] = (b.vocab, b.hidden)
    for i in range(b.num_layers):
        out.update(expected_layer_shapes(prefix, s, i))
    return out


# ---- pure layout helpers (used both ways, tested on their own) --------------------------------
def group_rows(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Per group ``g``: part 0's g-th block of rows, then part 1's, ...: megatron's grouped layout."""
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


def ungroup_rows(fused: torch.Tensor, groups: int, sizes: list[int]) -> list[torch.Tensor]:
    """Inverse of :func:`group_rows` (``sizes``: each part's rows per group)."""
    rest = fused.shape[1:]
    g = fused.reshape(groups, sum(sizes), *rest)
    return [p.reshape(-1, *rest).contiguous() for p in torch.split(g, sizes, dim=1)]


def split_q_gate(q_proj: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's per-head ``[q_h; gate_h]`` rows -> (q rows, gate rows), each head-major."""
    rest = q_proj.shape[1:]
    per_head = q_proj.reshape(-1, 2, head_dim, *rest)
    return per_head[:, 0].reshape(-1, *rest), per_head[:, 1].reshape(-1, *rest)


def join_q_gate(q: torch.Tensor, gate: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_q_gate`."""
    rest = q.shape[1:]
    return torch.stack([q.reshape(-1, head_dim, *rest), gate.reshape(-1, head_dim, *rest)], dim=1).reshape(-1, *rest)


# ---- HF -> megatron -------------------------------------------------------------------------------
def _offset(span: tuple[int, int], base: int) -> tuple[int, int]:
    return span[0] + base, span[1] + base


def _gdn_layer(ckpt: HFCheckpoint, A: str, M: str, s: HybridShape, rank: int, tp: int) -> dict[str, torch.Tensor]:
    hidden = s.base.hidden
    qk, v, vh = _span(s.qk, rank, tp), _span(s.v, rank, tp), _span(s.value_heads, rank, tp)
    qkv_rows = [qk, _offset(qk, s.qk), _offset(v, 2 * s.qk)]  # this rank's q, k, v rows of in_proj_qkv
    name = A + "in_proj_qkv.weight"
    in_proj = [ckpt.read(name, rows=r) for r in qkv_rows]
    in_proj += [ckpt.read(A + "in_proj_z.weight", rows=v), ckpt.read(A + "in_proj_b.weight", rows=vh),
                ckpt.read(A + "in_proj_a.weight", rows=vh)]
    conv = torch.cat([ckpt.read(A + "conv1d.weight", rows=r) for r in qkv_rows], dim=0)
    return {M + "in_proj.weight": torch.cat(in_proj, dim=0), M + "conv1d.weight": conv,
            M + "A_log": ckpt.read(A + "A_log", rows=vh), M + "dt_bias": ckpt.read(A + "dt_bias", rows=vh),
            M + "out_norm.weight": ckpt.read(A + "norm.weight"),
            M + "out_proj.weight": ckpt.read(A + "out_proj.weight", rows=(0, hidden), cols=v)}


def _attention_layer(ckpt: HFCheckpoint, A: str, M: str, s: HybridShape, rank: int, tp: int) -> dict[str, torch.Tensor]:
    b = s.base
    q_heads = _span(b.heads, rank, tp)
    q_rows = _span(b.heads * b.head_dim, rank, tp)
    kv_rows = _span(b.kv_heads * b.head_dim, rank, tp)
    q, gate = split_q_gate(ckpt.read(A + "q_proj.weight", rows=(2 * q_heads[0] * b.head_dim, 2 * q_heads[1] * b.head_dim)),
                           b.head_dim)
    k = ckpt.read(A + "k_proj.weight", rows=kv_rows)
    v = ckpt.read(A + "v_proj.weight", rows=kv_rows)
    return {M + "linear_qkv.weight": group_rows([q, gate, k, v], b.kv_heads // tp),
            M + "q_layernorm.weight": ckpt.read(A + "q_norm.weight"),
            M + "k_layernorm.weight": ckpt.read(A + "k_norm.weight"),
            M + "linear_proj.weight": ckpt.read(A + "o_proj.weight", rows=(0, b.hidden), cols=q_rows)}


def iter_hybrid_shard(ckpt: HFCheckpoint, prefix: str, lm_head: str, s: HybridShape, *, tp_rank: int, tp: int,
                      layer_offset: int, num_local_layers: int, pre_process: bool, post_process: bool
                      ) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's megatron state (names without ``language_model.``): the edge tensors, then one
    decoder layer at a time (global layer ``layer_offset + j`` is local layer ``j``)."""
    b = s.base
    out: dict[str, torch.Tensor] = {}
    if pre_process:
        out["embedding.word_embeddings.weight"] = _vocab_rows(ckpt, f"{prefix}embed_tokens.weight", b, tp_rank, tp)
    if post_process:
        out["decoder.final_layernorm.weight"] = ckpt.read(f"{prefix}norm.weight")
        if not b.tied:
            out["output_layer.weight"] = _vocab_rows(ckpt, lm_head, b, tp_rank, tp)
        elif not pre_process:  # tied and PP > 1: the last stage keeps its own copy of the embedding
            out["output_layer.weight"] = _vocab_rows(ckpt, f"{prefix}embed_tokens.weight", b, tp_rank, tp)
    yield out
    ffn = _span(b.ffn, tp_rank, tp)
    for j in range(num_local_layers):
        i = layer_offset + j
        L, M = f"{prefix}layers.{i}.", f"decoder.layers.{j}."
        if s.layer_types[i] == LINEAR:
            out = _gdn_layer(ckpt, L + "linear_attn.", M + "self_attention.", s, tp_rank, tp)
        else:
            out = _attention_layer(ckpt, L + "self_attn.", M + "self_attention.", s, tp_rank, tp)
        out[M + "input_layernorm.weight"] = ckpt.read(L + "input_layernorm.weight")
        out[M + "pre_mlp_layernorm.weight"] = ckpt.read(L + "post_attention_layernorm.weight")
        if i not in b.moe_layers:
            out[M + "mlp.linear_fc1.weight"] = torch.cat([ckpt.read(L + "mlp.gate_proj.weight", rows=ffn),
                                                          ckpt.read(L + "mlp.up_proj.weight", rows=ffn)], dim=0)
            out[M + "mlp.linear_fc2.weight"] = ckpt.read(L + "mlp.down_proj.weight", rows=(0, b.hidden), cols=ffn)
        yield out


# ---- megatron (TP=1) -> HF ----------------------------------------------------------------------
def export_hybrid(sd: dict[str, torch.Tensor], prefix: str, lm_head: str, s: HybridShape) -> dict[str, torch.Tensor]:
    """TP=1 megatron tensors (no prefix; any part made of whole layers and single edge tensors) -> HF."""
    b = s.base
    out = {}
    if "embedding.word_embeddings.weight" in sd:
        out[f"{prefix}embed_tokens.weight"] = sd["embedding.word_embeddings.weight"][: b.vocab]
    if "decoder.final_layernorm.weight" in sd:
        out[f"{prefix}norm.weight"] = sd["decoder.final_layernorm.weight"]
    if "output_layer.weight" in sd and not b.tied:
        out[lm_head] = sd["output_layer.weight"][: b.vocab]
    for i in sorted({int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")}):
        out.update(_export_layer(sd, prefix, s, i))
    return {k: v.contiguous() for k, v in out.items()}


def _export_layer(sd: dict[str, torch.Tensor], prefix: str, s: HybridShape, i: int) -> dict[str, torch.Tensor]:
    b = s.base
    L, M = f"{prefix}layers.{i}.", f"decoder.layers.{i}."
    S = M + "self_attention."
    if s.layer_types[i] == LINEAR:
        A = L + "linear_attn."
        q, k, v, z, beta, alpha = torch.split(sd[S + "in_proj.weight"],
                                              [s.qk, s.qk, s.v, s.v, s.value_heads, s.value_heads], dim=0)
        out = {A + "in_proj_qkv.weight": torch.cat([q, k, v], dim=0), A + "in_proj_z.weight": z,
               A + "in_proj_b.weight": beta, A + "in_proj_a.weight": alpha, A + "conv1d.weight": sd[S + "conv1d.weight"],
               A + "A_log": sd[S + "A_log"], A + "dt_bias": sd[S + "dt_bias"], A + "norm.weight": sd[S + "out_norm.weight"],
               A + "out_proj.weight": sd[S + "out_proj.weight"]}
    else:
        A = L + "self_attn."
        hpg = b.heads // b.kv_heads
        q, gate, k, v = ungroup_rows(sd[S + "linear_qkv.weight"], b.kv_heads,
                                     [hpg * b.head_dim, hpg * b.head_dim, b.head_dim, b.head_dim])
        out = {A + "q_proj.weight": join_q_gate(q, gate, b.head_dim), A + "k_proj.weight": k, A + "v_proj.weight": v,
               A + "q_norm.weight": sd[S + "q_layernorm.weight"], A + "k_norm.weight": sd[S + "k_layernorm.weight"],
               A + "o_proj.weight": sd[S + "linear_proj.weight"]}
    out[L + "input_layernorm.weight"] = sd[M + "input_layernorm.weight"]
    out[L + "post_attention_layernorm.weight"] = sd[M + "pre_mlp_layernorm.weight"]
    if i not in b.moe_layers:
        gate_w, up = torch.split(sd[M + "mlp.linear_fc1.weight"], [b.ffn, b.ffn], dim=0)
        out.update({L + "mlp.gate_proj.weight": gate_w, L + "mlp.up_proj.weight": up,
                    L + "mlp.down_proj.weight": sd[M + "mlp.linear_fc2.weight"]})
    return out
