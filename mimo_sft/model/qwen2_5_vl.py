"""Qwen2.5-VL: HF config -> megatron configs, vision encoder, weight conversion both ways.

Language: megatron ``GPTModel`` (local spec) with mRoPE (``mrope_section`` in HF's order, not
interleaved, ``rotary_base=rope_theta``), RMSNorm with the checkpoint's eps, gated SiLU MLP, qkv bias,
GQA. Vision: transformers' own ``Qwen2_5_VisionTransformerPretrainedModel`` (a plain ``nn.Module``
that loads HF weights as they are), returning the patch merger's output ``[merged_tokens, hidden]``
in per-sample order -- never ``[S, B, H]``, which MimoModel would flatten across samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimo_sft.config.families import QWEN2_5_VL
from mimo_sft.errors import UserError
from mimo_sft.model.decoder_weights import (DecoderNames, DecoderShape, expected_hf_shapes, export_decoder,
                                            iter_decoder_shard, pad_vocab)
from mimo_sft.model.family import FamilyAdapter, ModelInfo
from mimo_sft.model.hf_checkpoint import iter_blocks
from mimo_sft.model.pixels import PixelNorm, no_image_rows, tower_input
from mimo_sft.model.vision_attention import SegmentAttentionTower, host_vision_kwargs
from mimo_sft.parallel.layout import IMAGES

try:  # transformers is a hard dependency; the import is here so the error names the family
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
except ImportError as _err:  # pragma: no cover
    raise ImportError(f"Qwen2.5-VL support needs transformers>=5 ({_err})")


class Qwen25VisionEncoder(SegmentAttentionTower, Qwen2_5_VisionTransformerPretrainedModel):
    """HF's Qwen2.5-VL vision tower + patch merger as a MIMO encoder.

    ``pixel_values`` are uint8 patches from the data path (normalised here, on the device:
    ``model.pixels``) or transformers' float patches. ``forward(pixel_values, image_grid_thw)`` returns the merged tokens ``[sum_i t*h*w/merge**2,
    out_hidden]`` (images in batch order), which MimoModel scatters onto the image placeholders.
    Parameter names are exactly HF's (``patch_embed.*``, ``blocks.N.*``, ``merger.*``).

    Attention (``model.vision_attention``): with ``--attention-backend sdpa`` one SDPA call per block
    over all windows or all images of the micro-batch; positions, window order and bounds come from
    the host ``image_grid_thw`` (the forward step hands the host copy), so no block reads the device.

    Zero images (a colocated bridge's gather group needs every rank's encoder output, see
    ``train.bridge``) give ``[0, out_hidden]`` connected to every trainable parameter, so it requires
    grad exactly when an output with images would, and its (zero) gradient reaches them.
    """

    #: set by ``model.builder`` from the checkpoint (``model.pixels``): how uint8 patches become floats
    pixel_norm: PixelNorm | None = None
    #: LoRA vision target -> regex full-matching the names of the linears it adapts (``model.lora``)
    LORA_LAYERS = {"vision_attn": r"blocks\.\d+\.attn\.(qkv|proj)",
                   "vision_mlp": r"blocks\.\d+\.mlp\.(gate|up|down)_proj",
                   "merger": r"merger\.mlp\.[02]"}

    @staticmethod
    def is_projector(name: str) -> bool:
        """Parameters of the projector (the patch merger): ``--freeze-projector``, the ``merger`` target."""
        return name.startswith("merger.")

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:  # noqa: D401
        if image_grid_thw.shape[0] == 0:
            return self._no_images()
        patches, image_grid_thw = tower_input(pixel_values, image_grid_thw, self.pixel_norm,
                                              self.patch_embed.proj.weight.dtype, self.config.temporal_patch_size)
        precomputed = host_vision_kwargs(image_grid_thw, self.config, patches.device)
        return super().forward(hidden_states=patches, grid_thw=image_grid_thw, **precomputed).pooler_output

    def _no_images(self) -> torch.Tensor:
        weight = self.merger.mlp[2].weight  # [out_hidden, context]: the output's width and dtype
        return no_image_rows(self, weight, weight.shape[0])


class Qwen25VLAdapter(FamilyAdapter):
    spec = QWEN2_5_VL  # name, model types, modalities and parallel limits
    encoder_name = "qwen_vit"
    @property
    def qkv_bias(self) -> bool:
        """The decoder's attention (the descriptor's ``architecture``): a q/k/v bias (Qwen2/2.5) ..."""
        return self.spec.architecture.qkv_bias

    @property
    def qk_norm(self) -> bool:
        """... or RMSNorm over the head dimension of q and k (Qwen3)."""
        return self.spec.architecture.qk_norm

    # ---- config ------------------------------------------------------------------------------
    #: transformers' config class, how messages name the family, and where its config.json keeps mrope_section
    hf_config_class = "Qwen2_5_VLConfig"
    display_name = "Qwen2.5-VL"
    mrope_where = "rope_parameters/rope_scaling"
    mrope_example = '"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}'

    def load_hf_config(self, hf_dir: str, raw: dict):
        import transformers

        try:
            cfg = getattr(transformers, self.hf_config_class).from_pretrained(hf_dir)
        except Exception as err:
            raise UserError(f"{hf_dir}/config.json is not a valid {self.display_name} config ({err.__class__.__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}); fix or restore config.json") from None
        rope = getattr(cfg.text_config, "rope_parameters", None) or {}
        if not rope.get("mrope_section"):
            raise UserError(f"{hf_dir}/config.json has no mrope_section in {self.mrope_where}; "
                            f"{self.display_name} needs it (e.g. {self.mrope_example})")
        return cfg

    def _shape(self, hf_cfg, padded_vocab: int) -> DecoderShape:
        t = hf_cfg.text_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        return DecoderShape(num_layers=t.num_hidden_layers, hidden=t.hidden_size, ffn=t.intermediate_size,
                            heads=t.num_attention_heads, kv_heads=t.num_key_value_heads, head_dim=head_dim,
                            vocab=t.vocab_size, padded_vocab=padded_vocab, tied=bool(hf_cfg.tie_word_embeddings))

    def _names(self, prefix_style: str) -> DecoderNames:
        return DecoderNames(prefix="model.language_model." if prefix_style == "nested" else "model.",
                            qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

    @staticmethod
    def _vision_prefix(prefix_style: str) -> str:
        return "model.visual." if prefix_style == "nested" else "visual."

    def info(self, hf_cfg, *, tp: int) -> ModelInfo:
        t, v = hf_cfg.text_config, hf_cfg.vision_config
        return ModelInfo(
            family=self.name, model_type=hf_cfg.model_type, hf_dir=None,
            image_token_id=hf_cfg.image_token_id, video_token_id=getattr(hf_cfg, "video_token_id", None),
            vision_start_token_id=getattr(hf_cfg, "vision_start_token_id", None),
            vision_end_token_id=getattr(hf_cfg, "vision_end_token_id", None),
            special_token_ids={IMAGES: hf_cfg.image_token_id},
            spatial_merge_size=v.spatial_merge_size, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
            vocab_size=t.vocab_size, padded_vocab_size=pad_vocab(t.vocab_size, tp), hidden_size=t.hidden_size,
            num_layers=t.num_hidden_layers, tie_word_embeddings=bool(hf_cfg.tie_word_embeddings),
            encoder_name=self.encoder_name, hf_config=hf_cfg)

    def language_transformer_config(self, hf_cfg, *, tp: int, pp: int, dtype: torch.dtype, random_init: bool,
                                    cpu_init: bool, overrides: dict):
        from megatron.core.transformer.transformer_config import TransformerConfig

        t = hf_cfg.text_config
        s = self._shape(hf_cfg, pad_vocab(t.vocab_size, tp))
        kwargs = dict(
            num_layers=t.num_hidden_layers, hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
            num_attention_heads=t.num_attention_heads, num_query_groups=t.num_key_value_heads, kv_channels=s.head_dim,
            normalization="RMSNorm", layernorm_epsilon=t.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm, hidden_dropout=0.0, attention_dropout=float(t.attention_dropout or 0.0),
            mrope_section=list(t.rope_parameters["mrope_section"]), rotary_interleaved=False,
            init_method_std=t.initializer_range,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
            use_cpu_initialization=cpu_init, perform_initialization=random_init,
            apply_rope_fusion=False, bias_activation_fusion=True, masked_softmax_fusion=False,
            bias_dropout_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            cross_entropy_loss_fusion=False,
            # the multi-module schedules need variable sequence lengths, which config validation
            # only accepts together with the alltoall dispatcher (a no-op for dense models)
            variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def vision_transformer_config(self, hf_cfg, *, dtype: torch.dtype, cpu_init: bool, overrides: dict):
        """A TransformerConfig for wrapping the (HF) encoder in megatron DDP: TP=PP=1, the dtype."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        v = hf_cfg.vision_config
        kwargs = dict(num_layers=v.depth, hidden_size=v.hidden_size, num_attention_heads=v.num_heads,
                      ffn_hidden_size=v.intermediate_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                      params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
                      use_cpu_initialization=cpu_init, gradient_accumulation_fusion=False,
                      variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        kwargs.update({k: v_ for k, v_ in overrides.items()
                       if k not in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
                                    "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                                    "kv_channels", "mrope_section")})
        return TransformerConfig(**kwargs)

    def language_model_params(self, hf_cfg, *, padded_vocab: int, max_seq_len: int) -> dict:
        t = hf_cfg.text_config
        return dict(vocab_size=padded_vocab, max_sequence_length=max_seq_len, position_embedding_type="mrope",
                    rotary_base=int(t.rope_parameters.get("rope_theta", 1e6)),
                    share_embeddings_and_output_weights=bool(hf_cfg.tie_word_embeddings), parallel_output=True,
                    # MIMO scatters the combined text+image embeddings itself under sequence parallelism
                    scatter_embedding_sequence_parallel=False)

    def block_spec(self, hf_cfg, num_local_layers: int, *, attention: str = "sdpa", layer_offset: int = 0):
        """megatron's local layer spec for ``num_local_layers`` layers, every norm ``model.norm.RMSNorm``
        (torch's RMSNorm whose weight megatron reduces over TP under sequence parallelism), with
        ``attention``'s core (``model.attention``: SDPA by default, megatron's local core on request).

        Spelled out as block submodules because megatron picks the final norm itself otherwise:
        apex's ``FusedLayerNorm`` whenever apex is importable, which asserts on RMSNorm.
        """
        from dataclasses import replace

        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from mimo_sft.model.attention import core_attention_class
        from mimo_sft.model.norm import RMSNorm

        layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.qk_norm)
        attn = layer.submodules.self_attention
        qk_norms = dict(q_layernorm=RMSNorm, k_layernorm=RMSNorm) if self.qk_norm else {}
        attn = replace(attn, submodules=replace(attn.submodules, core_attention=core_attention_class(attention),
                                                **qk_norms))
        layer = replace(layer, submodules=replace(layer.submodules, self_attention=attn, input_layernorm=RMSNorm,
                                                  pre_mlp_layernorm=RMSNorm))
        return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=RMSNorm)

    def encoder_class(self) -> type:
        return Qwen25VisionEncoder

    def encoder_params(self, hf_cfg, *, attn_implementation: str) -> dict:
        import copy

        vcfg = copy.deepcopy(hf_cfg.vision_config)
        vcfg._attn_implementation = attn_implementation
        return {"config": vcfg}

    # ---- weights -----------------------------------------------------------------------------
    def _vision_expected(self, hf_cfg, prefix: str) -> dict:
        v = hf_cfg.vision_config
        enc = Qwen25VisionEncoder._expected_shapes(v)
        return {prefix + k: s for k, s in enc.items()}

    def check_weights(self, ckpt, hf_cfg) -> None:
        style = ckpt.prefix_style
        s = self._shape(hf_cfg, hf_cfg.text_config.vocab_size)
        expected = dict(expected_hf_shapes(self._names(style), s))
        expected.update(self._vision_expected(hf_cfg, self._vision_prefix(style)))
        for name, shape in expected.items():
            ckpt.expect_shape(name, shape)

    def load_language(self, ckpt, hf_cfg, *, tp_rank, tp, layer_offset, num_local_layers, pre_process,
                      post_process, padded_vocab, experts=None):
        """This rank's language weights, one group (embeddings, then one layer) at a time."""
        return iter_decoder_shard(ckpt, self._names(ckpt.prefix_style), self._shape(hf_cfg, padded_vocab),
                                  tp_rank=tp_rank, tp=tp, layer_offset=layer_offset, num_local_layers=num_local_layers,
                                  pre_process=pre_process, post_process=post_process)

    def load_encoder(self, ckpt, hf_cfg):
        """The vision tower's tensors, one block at a time (``hf_checkpoint.iter_blocks``)."""
        return iter_blocks(ckpt, self._vision_prefix(ckpt.prefix_style))

    def export(self, language_sd, encoder_sd, hf_cfg, *, prefix_style: str) -> dict:
        # any part made of whole layers / single tensors converts on its own (the streamed export's groups)
        padded = language_sd.get("embedding.word_embeddings.weight", torch.empty(0)).shape[0]
        out = export_decoder(language_sd, self._names(prefix_style), self._shape(hf_cfg, padded))
        vp = self._vision_prefix(prefix_style)
        out.update({vp + k: v.contiguous() for k, v in encoder_sd.items()})
        return out

    def projector_param(self, name: str) -> bool:
        return self.encoder_class().is_projector(name)

    # ---- fixtures (testing.tiny_checkpoint) -----------------------------------------------------
    #: the tiny checkpoint's default patch size (the family's real one) and image normalisation
    #: (``None``: the Qwen2-VL image processor's defaults, which Qwen2.5-VL uses)
    tiny_patch_size = 14
    tiny_image_norm: dict = {}

    def vision_block_class(self) -> type:
        """transformers' vision block (one block's saved bytes: ``testing.saved_bytes``)."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock

        return Qwen2_5_VLVisionBlock

    def projector_modules(self, vision_config) -> list:
        """transformers' merger modules for ``vision_config`` (one merger's saved bytes: ``testing.saved_bytes``)."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPatchMerger

        v = vision_config
        return [Qwen2_5_VLPatchMerger(dim=v.out_hidden_size, context_dim=v.hidden_size,
                                      spatial_merge_size=v.spatial_merge_size)]

    def hf_model_class(self) -> type:
        """transformers' model class for this family's checkpoints (tiny checkpoints, references)."""
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration

    def tiny_config(self, ids: dict, *, vocab_size: int, max_positions: int, text: dict, vision: dict,
                    tie_embeddings: bool):
        """transformers' ``Qwen2_5_VLConfig`` for tiny sizes with Qwen2.5's constants (the released eps,
        rotary base, temporal patch, tokens per second); ``ids``: the tokenizer's special-token ids."""
        from transformers import Qwen2_5_VLConfig

        text_head_dim = text["hidden_size"] // text["num_attention_heads"]
        patch, merge, depth = vision["patch_size"], vision["spatial_merge_size"], vision["depth"]
        return Qwen2_5_VLConfig(
            text_config=dict(
                **text, vocab_size=vocab_size, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": mrope_section_for(text_head_dim)},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=tie_embeddings),
            vision_config=dict(
                **vision, intermediate_size=2 * vision["hidden_size"], temporal_patch_size=2, tokens_per_second=2,
                window_size=2 * patch * merge,  # two merged tokens per attention window side
                out_hidden_size=text["hidden_size"], fullatt_block_indexes=[depth - 1]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=tie_embeddings)


def mrope_section_for(head_dim: int) -> list[int]:
    """Split ``head_dim/2`` rotary frequencies into (t, h, w) in Qwen's 2:3:3 proportion."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def _expected_vision_shapes(v) -> dict:
    """The HF vision tensors a Qwen2.5-VL vision config implies (name -> shape)."""
    h, i, ctx = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    out = {"patch_embed.proj.weight": (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
           "merger.ln_q.weight": (h,), "merger.mlp.0.weight": (ctx, ctx), "merger.mlp.0.bias": (ctx,),
           "merger.mlp.2.weight": (v.out_hidden_size, ctx), "merger.mlp.2.bias": (v.out_hidden_size,)}
    for n in range(v.depth):
        b = f"blocks.{n}."
        out.update({b + "norm1.weight": (h,), b + "norm2.weight": (h,),
                    b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                    b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                    b + "mlp.gate_proj.weight": (i, h), b + "mlp.gate_proj.bias": (i,),
                    b + "mlp.up_proj.weight": (i, h), b + "mlp.up_proj.bias": (i,),
                    b + "mlp.down_proj.weight": (h, i), b + "mlp.down_proj.bias": (h,)})
    return out


Qwen25VisionEncoder._expected_shapes = staticmethod(_expected_vision_shapes)
