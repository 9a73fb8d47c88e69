"""Qwen3-VL-MoE: Qwen3-VL's adapter with mixture-of-experts decoder MLPs (megatron ``MoELayer``).

What differs from Qwen3-VL dense (transformers 5.23 ``Qwen3VLMoeTextSparseMoeBlock``): on the sparse
layers (``model.moe_weights.moe_layer_indexes``) the MLP is a router ``gate [E, H]`` -- an fp32
softmax over the experts, the top ``num_experts_per_tok``, renormalised to sum to one -- and ``E``
gated experts of width ``moe_intermediate_size`` whose outputs are summed with those weights; there
is no shared expert. megatron's ``TopKRouter`` with ``moe_router_score_function="softmax"`` and
``moe_router_pre_softmax=False`` takes the top k of the logits and softmaxes them, which is the
same distribution (softmax is monotonic; ``p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j)``),
computed in fp32 (``moe_router_dtype``). Experts run as ``SequentialMLP`` (one gated MLP per
local expert; Transformer Engine's grouped GEMM is not used) behind the alltoall token dispatcher,
over expert parallelism ``ep`` and expert tensor parallelism ``etp`` (the ``--component`` keys;
``config.checks`` refuses what does not divide). No token is dropped (no capacity factor), as in
transformers.

The load-balancing loss is off unless ``--moe-aux-loss-coeff`` > 0 (megatron's per-layer
``aux_loss``). transformers adds its own Switch-style loss over all layers jointly only when
``output_router_logits`` is set: the two are different losses, so no coefficient of one equals the
other (docs/model.md).

Vision: Qwen3-VL's tower with DeepStack, as :class:`model.qwen3_vl.Qwen3VisionEncoder` (transformers'
``Qwen3VLMoeVisionModel`` is the same code under another name).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mimo_sft.config.families import QWEN3_VL_MOE
from mimo_sft.model.moe_weights import (ExpertShape, ExpertSlice, expected_expert_shapes, export_experts,
                                        moe_layer_indexes, with_experts)
from mimo_sft.model.qwen3_vl import Qwen3VLAdapter


def moe_transformer_settings(hf_cfg) -> dict:
    """The megatron ``TransformerConfig`` fields that make its MoE layers compute transformers' block."""
    t = hf_cfg.text_config
    sparse = moe_layers_of(hf_cfg)
    shared = getattr(t, "shared_expert_intermediate_size", 0) or 0
    # Qwen3.5-MoE's shared expert: megatron's SharedExpertMLP with its sigmoid gate (gate_weight [1, h])
    shared_settings = dict(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True) if shared else {}
    return dict(**shared_settings, num_moe_experts=t.num_experts, moe_router_topk=t.num_experts_per_tok,
                moe_ffn_hidden_size=t.moe_intermediate_size,
                moe_layer_freq=[int(i in sparse) for i in range(t.num_hidden_layers)],
                moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_permute_fusion=False)


def moe_layers_of(hf_cfg) -> frozenset:
    t = hf_cfg.text_config
    return moe_layer_indexes(t.num_hidden_layers, t.num_experts, sparse_step=getattr(t, "decoder_sparse_step", 1),
                             mlp_only=getattr(t, "mlp_only_layers", None) or ())


def expert_shape_of(hf_cfg) -> ExpertShape:
    t = hf_cfg.text_config
    return ExpertShape(experts=t.num_experts, ffn=t.moe_intermediate_size, hidden=t.hidden_size,
                       shared_ffn=getattr(t, "shared_expert_intermediate_size", 0) or 0)


def moe_block_spec(dense_block, hf_cfg, *, layer_offset: int):
    """``dense_block`` (a ``TransformerBlockSubmodules``) with the sparse layers' MLP replaced by megatron's
    local ``MoELayer`` spec (``SequentialMLP`` experts), chosen per global layer index."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    sparse = moe_layers_of(hf_cfg)
    moe_mlp = get_gpt_layer_local_spec(num_experts=hf_cfg.text_config.num_experts, moe_grouped_gemm=False,
                                       normalization="RMSNorm").submodules.mlp
    layers = []
    for j, layer in enumerate(dense_block.layer_specs):
        if layer_offset + j in sparse:
            layer = replace(layer, submodules=replace(layer.submodules, mlp=moe_mlp))
        layers.append(layer)
    return replace(dense_block, layer_specs=layers)


class MoeAdapterMixin:
    """The MoE half of a mixture-of-experts family's adapter, over its dense one (``class X(MoeAdapterMixin,
    DenseAdapter)``): the sparse layers' megatron settings and ``MoELayer`` spec, and their router and experts
    added to the dense adapter's weight checks, loading and export. The dense adapter reads, loads and exports
    everything else (its decoder layout -- plain or hybrid -- included), so a family differs only in
    :attr:`fused_expert_export` and, where it has no dense MLP, its ``_shape``."""

    #: export writes the experts fused (``gate_up_proj [E, 2I, H]``, as transformers' ``save_pretrained`` writes
    #: Qwen3-VL-MoE) or one tensor per expert (Qwen3.5-MoE's ``save_pretrained`` layout)
    fused_expert_export: bool = True

    def _shape(self, hf_cfg, padded_vocab: int):
        return replace(super()._shape(hf_cfg, padded_vocab), moe_layers=moe_layers_of(hf_cfg))

    def language_transformer_config(self, hf_cfg, *, tp: int, pp: int, dtype: torch.dtype, random_init: bool,
                                    cpu_init: bool, overrides: dict):
        # the run's settings (ep, etp, the aux-loss coefficient: model.builder) override the family's
        return super().language_transformer_config(
            hf_cfg, tp=tp, pp=pp, dtype=dtype, random_init=random_init, cpu_init=cpu_init,
            overrides={**moe_transformer_settings(hf_cfg), **overrides})

    def block_spec(self, hf_cfg, num_local_layers: int, *, attention: str = "sdpa", layer_offset: int = 0):
        dense = super().block_spec(hf_cfg, num_local_layers, attention=attention, layer_offset=layer_offset)
        return moe_block_spec(dense, hf_cfg, layer_offset=layer_offset)

    def check_weights(self, ckpt, hf_cfg) -> None:
        super().check_weights(ckpt, hf_cfg)
        prefix = self._names(ckpt.prefix_style).prefix
        for name, shape in expected_expert_shapes(ckpt, prefix, moe_layers_of(hf_cfg), expert_shape_of(hf_cfg)).items():
            ckpt.expect_shape(name, shape)

    def load_language(self, ckpt, hf_cfg, *, tp_rank, tp, layer_offset, num_local_layers, pre_process,
                      post_process, padded_vocab, experts=None):
        """The dense adapter's groups, each sparse layer's router and experts added to its layer's group. The
        default slice splits a shared expert over tp (``ExpertSlice``); without one tp is not read."""
        dense = super().load_language(ckpt, hf_cfg, tp_rank=tp_rank, tp=tp, layer_offset=layer_offset,
                                      num_local_layers=num_local_layers, pre_process=pre_process,
                                      post_process=post_process, padded_vocab=padded_vocab)
        return with_experts(dense, ckpt, self._names(ckpt.prefix_style).prefix, layer_offset=layer_offset,
                            moe_layers=moe_layers_of(hf_cfg), s=expert_shape_of(hf_cfg),
                            where=experts or ExpertSlice(tp_rank=tp_rank, tp=tp))

    def export(self, language_sd, encoder_sd, hf_cfg, *, prefix_style: str) -> dict:
        out = super().export(language_sd, encoder_sd, hf_cfg, prefix_style=prefix_style)
        out.update(export_experts(language_sd, self._names(prefix_style).prefix, moe_layers_of(hf_cfg),
                                  expert_shape_of(hf_cfg), fused=self.fused_expert_export))
        return out


class Qwen3VLMoeAdapter(MoeAdapterMixin, Qwen3VLAdapter):
    """Qwen3-VL-MoE: Qwen3-VL's adapter whose sparse decoder layers are megatron ``MoELayer``s."""

    spec = QWEN3_VL_MOE
    hf_config_class = "Qwen3VLMoeConfig"
    display_name = "Qwen3-VL-MoE"

    # ---- fixtures (testing.tiny_checkpoint) -----------------------------------------------------
    def hf_model_class(self) -> type:
        from transformers import Qwen3VLMoeForConditionalGeneration

        return Qwen3VLMoeForConditionalGeneration

    def tiny_config(self, ids: dict, *, vocab_size: int, max_positions: int, text: dict, vision: dict,
                    tie_embeddings: bool):
        """Qwen3-VL's tiny config as a ``Qwen3VLMoeConfig`` with 8 experts, top 2, every layer sparse. The
        experts' width is 3/4 of the hidden size, so neither fused tensor is square in its last two dims
        (a transposed layout cannot pass for the other)."""
        from transformers import Qwen3VLMoeConfig

        dense = super().tiny_config(ids, vocab_size=vocab_size, max_positions=max_positions, text=text,
                                    vision=vision, tie_embeddings=tie_embeddings)
        t = dense.text_config.to_dict()
        for key in ("model_type", "transformers_version", "architectures", "dtype"):
            t.pop(key, None)
        t.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3 * text["hidden_size"] // 4,
                 decoder_sparse_step=1, mlp_only_layers=[])
        v = dense.vision_config.to_dict()
        for key in ("model_type", "transformers_version", "architectures", "dtype"):
            v.pop(key, None)
        return Qwen3VLMoeConfig(text_config=t, vision_config=v, image_token_id=dense.image_token_id,
                                video_token_id=dense.video_token_id,
                                vision_start_token_id=dense.vision_start_token_id,
                                vision_end_token_id=dense.vision_end_token_id, tie_word_embeddings=tie_embeddings)

