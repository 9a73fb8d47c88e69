"""Qwen3.5 (dense): the hybrid Gated DeltaNet decoder on Qwen3-VL's adapter.

Language: ``text_config.layer_types`` picks each layer's token mixer. "linear_attention" layers are
megatron-core's own ``GatedDeltaNet`` (four projections fused into one ``in_proj``, a depthwise
causal conv over ``[q|k|v]``, the chunked gated delta rule, a gated RMSNorm over the value head
dim, ``out_proj``), whose fla kernels have torch stand-ins on machines without fla
(``model.gdn_kernels``). "full_attention" layers are megatron's ``SelfAttention`` with the per-head
output gate (``attention_output_gate``), q/k RMSNorm, partial rotary (``rotary_percent`` =
``partial_rotary_factor``) and Qwen3-VL's interleaved mRoPE. Every RMSNorm except the GDN output
norm is zero-centred (``model.norm.ZeroCenteredRMSNorm``). The layer spec is built per pipeline
stage from the global layer indexes, so a stage boundary may fall anywhere in the 3:1 pattern.

Vision: transformers' ``Qwen3_5VisionModel`` (Qwen3-VL's tower without DeepStack), one merged token
per row, as Qwen2.5-VL's. The ``mtp.*`` tensors of released checkpoints (multi-token prediction,
which transformers ignores) are not built; export copies them from the source folder.
"""

from __future__ import annotations

import torch

from mimo_sft.config.families import QWEN3_5
from mimo_sft.errors import UserError
from mimo_sft.model import hybrid_weights as hw
from mimo_sft.model.pixels import no_image_rows, tower_input
from mimo_sft.model.qwen3_vl import Qwen3VLAdapter, _interleaved_rotary_class, expected_vision_shapes
from mimo_sft.model.vision_attention import SegmentAttentionTower, host_interpolated_kwargs

try:  # transformers is a hard dependency; the import is here so the error names the family
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
except ImportError as _err:  # pragma: no cover
    raise ImportError(f"Qwen3.5 support needs transformers>=5.23 with models/qwen3_5 ({_err})")


class Qwen35VisionEncoder(SegmentAttentionTower, Qwen3_5VisionModel):
    """HF's Qwen3.5 vision tower and merger as one MIMO encoder: ``forward(pixel_values,
    image_grid_thw)`` -> ``[sum_i t*h*w/merge**2, out_hidden]``; parameter names exactly HF's."""

    pixel_norm = None  # set by model.builder from the checkpoint
    LORA_LAYERS = {"vision_attn": r"blocks\.\d+\.attn\.(qkv|proj)",
                   "vision_mlp": r"blocks\.\d+\.mlp\.linear_fc[12]",
                   "merger": r"merger\.linear_fc[12]"}

    @staticmethod
    def is_projector(name: str) -> bool:
        return name.startswith("merger.")

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:  # noqa: D401
        if image_grid_thw.shape[0] == 0:
            return self._no_images()
        patches, image_grid_thw = tower_input(pixel_values, image_grid_thw, self.pixel_norm,
                                              self.patch_embed.proj.weight.dtype, self.config.temporal_patch_size)
        precomputed = host_interpolated_kwargs(image_grid_thw, self, patches.device)
        return super().forward(hidden_states=patches, grid_thw=image_grid_thw, **precomputed).pooler_output

    def _no_images(self) -> torch.Tensor:
        weight = self.merger.linear_fc2.weight  # [out_hidden, context]
        return no_image_rows(self, weight, weight.shape[0])


_LANGUAGE_CLASS: list = []


def qwen3_5_gpt_model_class() -> type:
    """megatron's ``GPTModel`` with Qwen3-VL's interleaved mRoPE (over the rotary part of each head)."""
    if _LANGUAGE_CLASS:
        return _LANGUAGE_CLASS[0]
    from megatron.core.models.gpt import GPTModel

    rotary = _interleaved_rotary_class()

    class Qwen35GPTModel(GPTModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            assert type(self.rotary_pos_emb).__name__ == "MultimodalRotaryEmbedding", type(self.rotary_pos_emb)
            self.rotary_pos_emb.__class__ = rotary

    Qwen35GPTModel.__qualname__ = "Qwen35GPTModel"
    _LANGUAGE_CLASS.append(Qwen35GPTModel)
    return Qwen35GPTModel


def _layer_spec(kind: str, attention: str):
    """One decoder layer's megatron spec: a GDN layer or a gated full-attention layer."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mimo_sft.model.attention import core_attention_class
    from mimo_sft.model.norm import GatedOutputRMSNorm, ZeroCenteredRMSNorm

    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    if kind == hw.LINEAR:
        mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedOutputRMSNorm, out_proj=RowParallelLinear))
    else:
        attn = layer.submodules.self_attention
        mixer = replace(attn, submodules=replace(attn.submodules, core_attention=core_attention_class(attention),
                                                 q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm))
    return replace(layer, submodules=replace(layer.submodules, self_attention=mixer,
                                             input_layernorm=ZeroCenteredRMSNorm,
                                             pre_mlp_layernorm=ZeroCenteredRMSNorm))


class Qwen35Adapter(Qwen3VLAdapter):
    """Qwen3.5 dense: Qwen3-VL's adapter with the hybrid decoder and the tower without DeepStack."""

    spec = QWEN3_5
    encoder_name = "qwen_vit"

    hf_config_class = "Qwen3_5Config"
    display_name = "Qwen3.5"
    mrope_where = "text_config.rope_parameters"
    mrope_example = '"mrope_section": [11, 11, 10], "mrope_interleaved": true'

    @staticmethod
    def num_deepstack(hf_cfg) -> int:
        return 0

    def load_hf_config(self, hf_dir: str, raw: dict):
        cfg = super().load_hf_config(hf_dir, raw)
        t = cfg.text_config
        if len(t.layer_types) != t.num_hidden_layers or set(t.layer_types) - {hw.LINEAR, hw.FULL}:
            raise UserError(f"{hf_dir}/config.json: text_config.layer_types must list {t.num_hidden_layers} entries "
                            f"(num_hidden_layers), each {hw.LINEAR!r} or {hw.FULL!r}; fix layer_types")
        return cfg

    def hybrid_shape(self, hf_cfg, padded_vocab: int) -> hw.HybridShape:
        return hw.hybrid_shape(hf_cfg.text_config, self._shape(hf_cfg, padded_vocab))

    # ---- megatron ------------------------------------------------------------------------------
    def language_transformer_config(self, hf_cfg, *, tp: int, pp: int, dtype: torch.dtype, random_init: bool,
                                    cpu_init: bool, overrides: dict):
        t = hf_cfg.text_config
        pattern = [1 if kind == hw.LINEAR else 0 for kind in t.layer_types]
        gdn = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=pattern,
                   linear_conv_kernel_dim=t.linear_conv_kernel_dim, linear_key_head_dim=t.linear_key_head_dim,
                   linear_value_head_dim=t.linear_value_head_dim, linear_num_key_heads=t.linear_num_key_heads,
                   linear_num_value_heads=t.linear_num_value_heads, attention_output_gate=True)
        return super().language_transformer_config(hf_cfg, tp=tp, pp=pp, dtype=dtype, random_init=random_init,
                                                   cpu_init=cpu_init, overrides={**gdn, **overrides})

    def language_model_params(self, hf_cfg, *, padded_vocab: int, max_seq_len: int) -> dict:
        params = super().language_model_params(hf_cfg, padded_vocab=padded_vocab, max_seq_len=max_seq_len)
        params["rotary_percent"] = float(hf_cfg.text_config.rope_parameters.get("partial_rotary_factor", 1.0))
        return params

    def block_spec(self, hf_cfg, num_local_layers: int, *, attention: str = "sdpa", layer_offset: int = 0):
        """This stage's layers, each by its global index's ``layer_types`` entry."""
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from mimo_sft.model.gdn_binding import install
        from mimo_sft.model.norm import ZeroCenteredRMSNorm

        install()  # fla's kernels where they are correct, else the torch ones (gdn_path)
        kinds = hf_cfg.text_config.layer_types[layer_offset:layer_offset + num_local_layers]
        specs = {kind: _layer_spec(kind, attention) for kind in set(kinds)}
        return TransformerBlockSubmodules(layer_specs=[specs[k] for k in kinds], layer_norm=ZeroCenteredRMSNorm)

    def language_model_class(self, hf_cfg) -> type:
        return qwen3_5_gpt_model_class()

    def mimo_model_class(self, hf_cfg) -> type:
        from megatron.core.models.mimo import MimoModel

        from mimo_sft.model.token_positions import host_positions_class

        return host_positions_class(MimoModel)

    def encoder_class(self) -> type:
        return Qwen35VisionEncoder

    # ---- weights -------------------------------------------------------------------------------
    def _vision_expected(self, hf_cfg, prefix: str) -> dict:
        return {prefix + k: s for k, s in expected_vision_shapes(hf_cfg.vision_config).items()}

    def _decoder_prefix(self, prefix_style: str) -> str:
        return self._names(prefix_style).prefix

    def check_weights(self, ckpt, hf_cfg) -> None:
        style = ckpt.prefix_style
        s = self.hybrid_shape(hf_cfg, hf_cfg.text_config.vocab_size)
        expected = hw.expected_hf_shapes(self._decoder_prefix(style), "lm_head.weight", s)
        expected.update(self._vision_expected(hf_cfg, self._vision_prefix(style)))
        for name, shape in expected.items():
            ckpt.expect_shape(name, shape)

    def load_language(self, ckpt, hf_cfg, *, tp_rank, tp, layer_offset, num_local_layers, pre_process,
                      post_process, padded_vocab, experts=None):
        return hw.iter_hybrid_shard(ckpt, self._decoder_prefix(ckpt.prefix_style), "lm_head.weight",
                                    self.hybrid_shape(hf_cfg, padded_vocab), tp_rank=tp_rank, tp=tp,
                                    layer_offset=layer_offset, num_local_layers=num_local_layers,
                                    pre_process=pre_process, post_process=post_process)

    def export(self, language_sd, encoder_sd, hf_cfg, *, prefix_style: str) -> dict:
        padded = language_sd.get("embedding.word_embeddings.weight", torch.empty(0)).shape[0]
        out = hw.export_hybrid(language_sd, self._decoder_prefix(prefix_style), "lm_head.weight",
                               self.hybrid_shape(hf_cfg, padded))
        vp = self._vision_prefix(prefix_style)
        out.update({vp + k: v.contiguous() for k, v in encoder_sd.items()})
        return out

    @staticmethod
    def passthrough(name: str) -> bool:
        """Source tensors export copies as they are (not part of the trained model): ``mtp.*``."""
        return name.startswith("mtp.")

    # ---- fixtures (testing.tiny_checkpoint) -----------------------------------------------------
    def vision_block_class(self) -> type:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionBlock

        return Qwen3_5VisionBlock

    def projector_modules(self, vision_config) -> list:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionPatchMerger

        return [Qwen3_5VisionPatchMerger(vision_config)]

    def hf_model_class(self) -> type:
        from transformers import Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration

    def tiny_config(self, ids: dict, *, vocab_size: int, max_positions: int, text: dict, vision: dict,
                    tie_embeddings: bool):
        """transformers' ``Qwen3_5Config`` for tiny sizes with Qwen3.5's constants (eps 1e-6, rotary base
        1e7, partial rotary 0.25 with interleaved mRoPE). The layer pattern is the released 3:1 one, with
        the full-attention interval cut to the layer count so both kinds are built; the GDN has twice as
        many value heads as key heads (as the 27B model: 16 key, 48 value; ``text`` may name other counts) and
        16-wide heads."""
        from transformers import Qwen3_5Config

        text = dict(text)
        gdn = dict(linear_num_key_heads=text.pop("linear_num_key_heads", 2),
                   linear_num_value_heads=text.pop("linear_num_value_heads", 4))
        layers = text["num_hidden_layers"]
        head_dim = 2 * text["hidden_size"] // text["num_attention_heads"]
        freqs = head_dim // 8  # partial_rotary_factor 0.25: rotary dim head_dim/4, half as many frequencies
        interval = min(4, layers)
        layer_types = [hw.FULL if (i + 1) % interval == 0 else hw.LINEAR for i in range(layers)]
        return Qwen3_5Config(
            text_config=dict(
                **text, head_dim=head_dim, vocab_size=vocab_size, max_position_embeddings=max_positions,
                rms_norm_eps=1e-6, layer_types=layer_types, **gdn,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [freqs - 2 * (freqs // 4), freqs // 4, freqs // 4],
                                 "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=tie_embeddings),
            vision_config=dict(**vision, intermediate_size=2 * vision["hidden_size"], temporal_patch_size=2,
                               out_hidden_size=text["hidden_size"], num_position_embeddings=64),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=tie_embeddings)
