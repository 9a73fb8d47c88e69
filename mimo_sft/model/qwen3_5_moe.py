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

from mimo_sft.config.families import QWEN3_5_MOE
from mimo_sft.model.decoder_weights import DecoderShape
from mimo_sft.model.qwen3_5 import Qwen35Adapter
from mimo_sft.model.qwen3_vl_moe import MoeAdapterMixin, moe_layers_of


class Qwen35MoeAdapter(MoeAdapterMixin, Qwen35Adapter):
    """Qwen3.5-MoE: Qwen3.5's adapter whose layers' MLPs are megatron ``MoELayer``s with a gated shared expert
    (``MoeAdapterMixin`` adds the experts to the hybrid decoder's weights; the shared expert comes with
    ``expert_shape_of``'s ``shared_ffn``)."""

    spec = QWEN3_5_MOE
    hf_config_class = "Qwen3_5MoeConfig"
    display_name = "Qwen3.5-MoE"
    fused_expert_export = False  # per expert, as transformers' save_pretrained writes this family

    def load_hf_config(self, hf_dir: str, raw: dict):
        cfg = super().load_hf_config(hf_dir, raw)
        t = cfg.text_config
        if getattr(t, "intermediate_size", None) is None:
            # no dense MLP anywhere: the width megatron's config asks for is the experts' (never built)
            t.intermediate_size = t.moe_intermediate_size
        return cfg

    def _shape(self, hf_cfg, padded_vocab: int):
        # no dense MLP: the width is always the experts' (the dense adapter's shape reads
        # text_config.intermediate_size, which a Qwen3_5MoeConfig built in memory does not have)
        t = hf_cfg.text_config
        return DecoderShape(num_layers=t.num_hidden_layers, hidden=t.hidden_size, ffn=t.moe_intermediate_size,
                            heads=t.num_attention_heads, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                            vocab=t.vocab_size, padded_vocab=padded_vocab, tied=bool(hf_cfg.tie_word_embeddings),
                            moe_layers=moe_layers_of(hf_cfg))

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
