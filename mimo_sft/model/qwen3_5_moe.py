"""Qwen3.5-MoE: Qwen3.5's hybrid decoder (Gated DeltaNet and gated attention) with sparse MLPs.

What differs from Qwen3.5 dense (transformers 5.23 ``Qwen3_5MoeSparseMoeBlock``): every layer's MLP is
a router over ``num_experts`` experts (fp32 softmax, top ``num_experts_per_tok``, renormalised, as
Qwen3-VL-MoE's: ``model.qwen3_vl_moe``) plus a shared expert every token runs through, a gated MLP of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))`` and added to the routed
experts' sum. megatron builds that as its ``SharedExpertMLP`` with ``moe_shared_expert_gate`` (its
``gate_weight [1, h]`` is transformers' ``shared_expert_gate.weight``; the shared expert is split over tp
like a dense MLP). There is no dense MLP and no ``intermediate_size`` in the config.

Experts are read from the checkpoint's per-expert or fused tensors (``model.moe_weights``); export writes
them per expert, as transformers' ``save_pretrained`` writes this family.
"""

from __future__ import annotations

import torch

from mimo_sft.config.families import QWEN3_5_MOE
from mimo_sft.model import hybrid_weights as hw
from mimo_sft.model.decoder_weights import DecoderShape
from mimo_sft.model.moe_weights import ExpertSlice, expected_expert_shapes, export_experts, with_experts
from mimo_sft.model.qwen3_5 import Qwen35Adapter
from mimo_sft.model.qwen3_vl_moe import expert_shape_of, moe_block_spec, moe_layers_of, moe_transformer_settings


class Qwen35MoeAdapter(Qwen35Adapter):
    """Qwen3.5-MoE: Qwen3.5's adapter whose layers' MLPs are megatron ``MoELayer``s with a gated shared expert."""

    spec = QWEN3_5_MOE
    hf_config_class = "Qwen3_5MoeConfig"
    display_name = "Qwen3.5-MoE"

    def load_hf_config(self, hf_dir: str, raw: dict):
        cfg = super().load_hf_config(hf_dir, raw)
        t = cfg.text_config
        if getattr(t, "intermediate_size", None) is None:
            # no dense MLP anywhere: the width megatron's config asks for is the experts' (never built)
            t.intermediate_size = t.moe_intermediate_size
        return cfg

    def _shape(self, hf_cfg, padded_vocab: int):
        t = hf_cfg.text_config
        return DecoderShape(num_layers=t.num_hidden_layers, hidden=t.hidden_size, ffn=t.moe_intermediate_size,
                            heads=t.num_attention_heads, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                            vocab=t.vocab_size, padded_vocab=padded_vocab, tied=bool(hf_cfg.tie_word_embeddings),
                            moe_layers=moe_layers_of(hf_cfg))

    def language_transformer_config(self, hf_cfg, *, tp: int, pp: int, dtype: torch.dtype, random_init: bool,
                                    cpu_init: bool, overrides: dict):
        return super().language_transformer_config(
            hf_cfg, tp=tp, pp=pp, dtype=dtype, random_init=random_init, cpu_init=cpu_init,
            overrides={**moe_transformer_settings(hf_cfg), **overrides})

    def block_spec(self, hf_cfg, num_local_layers: int, *, attention: str = "sdpa", layer_offset: int = 0):
        dense = super().block_spec(hf_cfg, num_local_layers, attention=attention, layer_offset=layer_offset)
        return moe_block_spec(dense, hf_cfg, layer_offset=layer_offset)

    def check_weights(self, ckpt, hf_cfg) -> None:
        super().check_weights(ckpt, hf_cfg)
        prefix = self._decoder_prefix(ckpt.prefix_style)
        for name, shape in expected_expert_shapes(ckpt, prefix, moe_layers_of(hf_cfg), expert_shape_of(hf_cfg)).items():
            ckpt.expect_shape(name, shape)

    def load_language(self, ckpt, hf_cfg, *, tp_rank, tp, layer_offset, num_local_layers, pre_process,
                      post_process, padded_vocab, experts=None):
        prefix = self._decoder_prefix(ckpt.prefix_style)
        dense = hw.iter_hybrid_shard(ckpt, prefix, "lm_head.weight", self.hybrid_shape(hf_cfg, padded_vocab),
                                     tp_rank=tp_rank, tp=tp, layer_offset=layer_offset,
                                     num_local_layers=num_local_layers, pre_process=pre_process,
                                     post_process=post_process)
        where = experts or ExpertSlice(tp_rank=tp_rank, tp=tp)
        return with_experts(dense, ckpt, prefix, layer_offset=layer_offset, moe_layers=moe_layers_of(hf_cfg),
                            s=expert_shape_of(hf_cfg), where=where)

    def export(self, language_sd, encoder_sd, hf_cfg, *, prefix_style: str) -> dict:
        out = super().export(language_sd, encoder_sd, hf_cfg, prefix_style=prefix_style)
        out.update(export_experts(language_sd, self._decoder_prefix(prefix_style), moe_layers_of(hf_cfg),
                                  expert_shape_of(hf_cfg), fused=False))
        return out

    # ---- fixtures (testing.tiny_checkpoint) -----------------------------------------------------
    def hf_model_class(self) -> type:
        from transformers import Qwen3_5MoeForConditionalGeneration

        return Qwen3_5MoeForConditionalGeneration

    def tiny_config(self, ids: dict, *, vocab_size: int, max_positions: int, text: dict, vision: dict,
                    tie_embeddings: bool):
        """Qwen3.5's tiny config as a ``Qwen3_5MoeConfig``: 8 experts of 3/4 the hidden width, top 2, and a
        shared expert of the hidden width (so no two of the MLP tensors share a shape)."""
        from transformers import Qwen3_5MoeConfig

        dense = super().tiny_config(ids, vocab_size=vocab_size, max_positions=max_positions, text=text,
                                    vision=vision, tie_embeddings=tie_embeddings)
        drop = ("model_type", "transformers_version", "architectures", "dtype", "intermediate_size")
        t = {k: v for k, v in dense.text_config.to_dict().items() if k not in drop}
        t.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3 * text["hidden_size"] // 4,
                 shared_expert_intermediate_size=text["hidden_size"])
        v = {k: v for k, v in dense.vision_config.to_dict().items() if k not in drop[:4]}
        return Qwen3_5MoeConfig(text_config=t, vision_config=v, image_token_id=dense.image_token_id,
                                video_token_id=dense.video_token_id, vision_start_token_id=dense.vision_start_token_id,
                                vision_end_token_id=dense.vision_end_token_id, tie_word_embeddings=tie_embeddings)
