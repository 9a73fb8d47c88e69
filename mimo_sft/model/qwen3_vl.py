"""Qwen3-VL (dense): what differs from Qwen2.5-VL, on top of its adapter.

Language: Qwen3's decoder -- q/k RMSNorm over the head dimension (megatron ``qk_layernorm``), no qkv
bias, an explicit ``head_dim`` -- with **interleaved** mRoPE: the rotary frequency ``i`` follows the
height positions when ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, the width positions when
``i % 3 == 2`` and ``i < 3 * mrope_section[2]``, the temporal ones otherwise (transformers'
``Qwen3VLTextRotaryEmbedding``). megatron-core 0.19.2's ``MultimodalRotaryEmbedding`` implements only
Qwen2.5's chunked sections; :class:`InterleavedMultimodalRotaryEmbedding` replaces it in
:class:`Qwen3VLGPTModel`. Chunked and interleaved agree on text tokens (all three positions equal),
so only image tokens tell them apart (tested with images).

Vision: transformers' own ``Qwen3VLVisionModel`` (patch 16 Conv3d with bias, learned position
embedding interpolated to the grid, LayerNorm + GELU blocks, full attention, ``merger`` and one
``deepstack_merger_list`` merger per ``deepstack_visual_indexes`` block). The encoder returns one
tensor per image-token row, ``[main | deepstack_0 | ... | deepstack_{k-1}]``; ``model.deepstack``
splits it on the language side and adds the features after decoder layers 0..k-1.
"""

from __future__ import annotations

import torch

from mimo_sft.config.families import QWEN3_VL
from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter
from mimo_sft.model.pixels import no_image_rows, tower_input
from mimo_sft.model.vision_attention import SegmentAttentionTower, host_interpolated_kwargs

try:  # transformers is a hard dependency; the import is here so the error names the family
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
except ImportError as _err:  # pragma: no cover
    raise ImportError(f"Qwen3-VL support needs transformers>=5 with models/qwen3_vl ({_err})")


class Qwen3VisionEncoder(SegmentAttentionTower, Qwen3VLVisionModel):
    """HF's Qwen3-VL vision tower, merger and DeepStack mergers as one MIMO encoder.

    ``forward(pixel_values, image_grid_thw)`` returns ``[sum_i t*h*w/merge**2, out_hidden * (1 + k)]``:
    per merged token the main merger's output, then each deepstack merger's, in
    ``deepstack_visual_indexes`` order (``model.deepstack.split_deepstack`` reads it). Parameter names
    are exactly HF's. uint8 patches are normalised here (``model.pixels``), float patches pass as they
    are; zero images give zero rows connected to every trainable parameter (see ``Qwen25VisionEncoder``).
    """

    pixel_norm = None  # set by model.builder from the checkpoint
    #: LoRA vision target -> regex full-matching the linears it adapts: the blocks' attention and MLP, and
    #: every merger (the main one and the DeepStack ones) for ``merger``
    LORA_LAYERS = {"vision_attn": r"blocks\.\d+\.attn\.(qkv|proj)",
                   "vision_mlp": r"blocks\.\d+\.mlp\.linear_fc[12]",
                   "merger": r"(merger|deepstack_merger_list\.\d+)\.linear_fc[12]"}

    @staticmethod
    def is_projector(name: str) -> bool:
        """The main merger and the DeepStack mergers project vision features into the language model."""
        return name.startswith(("merger.", "deepstack_merger_list."))

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:  # noqa: D401
        if image_grid_thw.shape[0] == 0:
            return self._no_images()
        patches, image_grid_thw = tower_input(pixel_values, image_grid_thw, self.pixel_norm,
                                              self.patch_embed.proj.weight.dtype, self.config.temporal_patch_size)
        precomputed = host_interpolated_kwargs(image_grid_thw, self, patches.device)
        out = super().forward(hidden_states=patches, grid_thw=image_grid_thw, **precomputed)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def _no_images(self) -> torch.Tensor:
        weight = self.merger.linear_fc2.weight  # [out_hidden, context]
        return no_image_rows(self, weight, weight.shape[0] * (1 + len(self.deepstack_visual_indexes)))


def interleaved_mrope_axes(num_freqs: int, mrope_section) -> torch.Tensor:
    """Which position row (0 t, 1 h, 2 w) each of the ``num_freqs`` rotary frequencies reads.

    The same slices as transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``:
    ``slice(1, 3*section[1], 3)`` -> h, ``slice(2, 3*section[2], 3)`` -> w, the rest t.
    """
    axes = torch.zeros(num_freqs, dtype=torch.long)
    for row in (1, 2):
        axes[slice(row, 3 * int(mrope_section[row]), 3)] = row
    return axes


def _interleaved_rotary_class():
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
        """megatron's ``MultimodalRotaryEmbedding`` with Qwen3-VL's interleaved frequency-to-axis map.

        Returns what megatron's returns (``[S, B, 1, dim]`` angles, the two halves equal: the
        rotate-half convention, ``rotary_interleaved=False``); each angle is ``position * inv_freq``
        as transformers computes it (one fp32 product).
        """

        def forward(self, position_ids, mrope_section, cp_group=None):
            assert not self.rotary_interleaved, "Qwen3-VL rotates halves (rotary_interleaved=False)"
            seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            if self.seq_len_interpolation_factor is not None:
                seq = seq * (1 / self.seq_len_interpolation_factor)
            freqs = seq[..., None].float() * self.inv_freq  # [3, B, S, dim/2]
            axes = self._axes(freqs.shape[-1], tuple(mrope_section), freqs.device)
            picked = torch.gather(freqs, 0, axes.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]  # [B, S, dim/2]
            emb = torch.cat((picked, picked), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [S, B, 1, dim]
            cp_group = cp_group if cp_group is not None else self.cp_group
            if cp_group is not None and cp_group.size() > 1:
                emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
            return emb

        def _axes(self, num_freqs: int, section: tuple, device) -> torch.Tensor:
            """:func:`interleaved_mrope_axes` on the device, made once (not copied over every forward)."""
            cache = self.__dict__.setdefault("_mimo_axes", {})
            key = (num_freqs, section, str(device))
            if key not in cache:
                cache[key] = interleaved_mrope_axes(num_freqs, section).to(device)
            return cache[key]

    return InterleavedMultimodalRotaryEmbedding


_LANGUAGE_CLASSES: dict = {}


def qwen3_vl_gpt_model_class(num_deepstack: int) -> type:
    """megatron's ``GPTModel`` with interleaved mRoPE and DeepStack after layers ``0..num_deepstack-1``."""
    if num_deepstack in _LANGUAGE_CLASSES:
        return _LANGUAGE_CLASSES[num_deepstack]
    from megatron.core.models.gpt import GPTModel

    from mimo_sft.model.deepstack import DeepStackLanguageMixin

    rotary = _interleaved_rotary_class()

    class Qwen3VLGPTModel(DeepStackLanguageMixin, GPTModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # megatron built its chunked MultimodalRotaryEmbedding (frequencies, cp group): keep its
            # state, change only how frequencies map to the t/h/w position rows
            assert type(self.rotary_pos_emb).__name__ == "MultimodalRotaryEmbedding", type(self.rotary_pos_emb)
            self.rotary_pos_emb.__class__ = rotary
            self.init_deepstack(num_deepstack)

    Qwen3VLGPTModel.__qualname__ = "Qwen3VLGPTModel"
    _LANGUAGE_CLASSES[num_deepstack] = Qwen3VLGPTModel
    return Qwen3VLGPTModel


class Qwen3VLAdapter(Qwen25VLAdapter):
    """Qwen3-VL dense: Qwen2.5-VL's adapter with Qwen3's decoder, its vision tower and DeepStack."""

    spec = QWEN3_VL
    encoder_name = "qwen_vit"

    hf_config_class = "Qwen3VLConfig"
    display_name = "Qwen3-VL"
    mrope_where = "text_config.rope_scaling/rope_parameters"
    mrope_example = '"mrope_section": [24, 20, 20], "mrope_interleaved": true'

    @staticmethod
    def num_deepstack(hf_cfg) -> int:
        return len(hf_cfg.vision_config.deepstack_visual_indexes)

    def language_model_class(self, hf_cfg) -> type:
        return qwen3_vl_gpt_model_class(self.num_deepstack(hf_cfg))

    def mimo_model_class(self, hf_cfg) -> type:
        from mimo_sft.model.deepstack import deepstack_mimo_model_class
        from mimo_sft.parallel.layout import IMAGES

        return deepstack_mimo_model_class(IMAGES, self.num_deepstack(hf_cfg))

    def encoder_class(self) -> type:
        return Qwen3VisionEncoder

    def _vision_expected(self, hf_cfg, prefix: str) -> dict:
        return {prefix + k: s for k, s in expected_vision_shapes(hf_cfg.vision_config).items()}

    # ---- fixtures (testing.tiny_checkpoint) -----------------------------------------------------
    tiny_patch_size = 16
    #: Qwen3-VL's preprocessor_config.json normalises with mean = std = 0.5
    tiny_image_norm = {"image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5)}

    def vision_block_class(self) -> type:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock

        return Qwen3VLVisionBlock

    def projector_modules(self, vision_config) -> list:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

        k = len(vision_config.deepstack_visual_indexes)
        return [Qwen3VLVisionPatchMerger(vision_config)] + [
            Qwen3VLVisionPatchMerger(vision_config, use_postshuffle_norm=True) for _ in range(k)]

    def hf_model_class(self) -> type:
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration

    def tiny_config(self, ids: dict, *, vocab_size: int, max_positions: int, text: dict, vision: dict,
                    tie_embeddings: bool):
        """transformers' ``Qwen3VLConfig`` for tiny sizes with Qwen3-VL's constants (eps 1e-6, rotary base
        5e6, interleaved mRoPE in the released [24, 20, 20] proportion). The head dimension is twice
        hidden/heads, so the explicit ``head_dim`` (Qwen3's q/k widths differ from the hidden size) is
        exercised; DeepStack taps the first two vision blocks (or the only one)."""
        from transformers import Qwen3VLConfig

        head_dim = 2 * text["hidden_size"] // text["num_attention_heads"]
        half = head_dim // 2
        h = half * 20 // 64
        depth = vision["depth"]
        return Qwen3VLConfig(
            text_config=dict(
                **text, head_dim=head_dim, vocab_size=vocab_size, max_position_embeddings=max_positions,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                    "mrope_section": [half - 2 * h, h, h], "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=tie_embeddings),
            vision_config=dict(
                **vision, intermediate_size=2 * vision["hidden_size"], temporal_patch_size=2,
                out_hidden_size=text["hidden_size"], num_position_embeddings=64,
                deepstack_visual_indexes=list(range(min(depth, 2)))),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=tie_embeddings)


def expected_vision_shapes(v) -> dict:
    """The HF vision tensors a Qwen3-VL vision config implies (name -> shape)."""
    h, i, ctx = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    out = {"patch_embed.proj.weight": (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
           "patch_embed.proj.bias": (h,), "pos_embed.weight": (v.num_position_embeddings, h)}
    for n in range(v.depth):
        b = f"blocks.{n}."
        for name, shape in (("norm1", (h,)), ("norm2", (h,)), ("attn.qkv", (3 * h, h)), ("attn.proj", (h, h)),
                            ("mlp.linear_fc1", (i, h)), ("mlp.linear_fc2", (h, i))):
            out[b + name + ".weight"] = shape
            out[b + name + ".bias"] = (shape[0],)
    deepstack = getattr(v, "deepstack_visual_indexes", ())  # Qwen3.5's tower has none
    mergers = [("merger.", h)] + [(f"deepstack_merger_list.{j}.", ctx) for j in range(len(deepstack))]
    for m, norm in mergers:
        out.update({m + "norm.weight": (norm,), m + "norm.bias": (norm,),
                    m + "linear_fc1.weight": (ctx, ctx), m + "linear_fc1.bias": (ctx,),
                    m + "linear_fc2.weight": (v.out_hidden_size, ctx), m + "linear_fc2.bias": (v.out_hidden_size,)})
    return out
