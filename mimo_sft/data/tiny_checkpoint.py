"""A tiny random Qwen2.5-VL checkpoint folder for tests, demos and CPU runs.

Why: a real checkpoint is gigabytes with a 151k vocabulary; tests need the *same* file layout
(config.json, model.safetensors, tokenizer, image processor, chat template) at a size that builds,
loads and runs a forward in well under a second. The model is transformers' own
``Qwen2_5_VLForConditionalGeneration`` with random weights; the processor is the image-only one.
"""

from __future__ import annotations

import os
from pathlib import Path

from mimo_sft.errors import UserError


def mrope_section_for(head_dim: int) -> list[int]:
    """Split ``head_dim/2`` rotary frequencies into (t, h, w) in Qwen's 2:3:3 proportion."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


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
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    tokenizer_vocab: int = 1024,
) -> Path:
    """Write config.json, model.safetensors and the processor files to ``out_dir``; return it."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mimo_sft.data.processor import write_tiny_processor

    problems = []
    if (vision_hidden // max(vision_heads, 1)) % 4 or vision_hidden % max(vision_heads, 1):
        problems.append("--vision-hidden / --vision-heads must be a multiple of 4 (vision head_dim)")
    if text_hidden % heads or heads % kv_heads:
        problems.append("--text-hidden must divide by --heads and --heads by --kv-heads")
    elif (text_hidden // heads) % 2:
        problems.append("--text-hidden / --heads (text head_dim) must be even for rotary embeddings")
    if problems:
        raise UserError("; ".join(problems))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = write_tiny_processor(
        out, patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
        vocab_size=tokenizer_vocab,
    )
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                                     "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    vocab_size = -(-len(tok) // 64) * 64  # padded like Qwen's, always >= len(tokenizer)
    text_head_dim = text_hidden // heads
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=text_hidden,
            intermediate_size=intermediate,
            num_hidden_layers=text_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": mrope_section_for(text_head_dim)},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=tie_embeddings,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=vision_heads,
            patch_size=patch_size,
            spatial_merge_size=merge_size,
            temporal_patch_size=2,
            tokens_per_second=2,
            window_size=2 * patch_size * merge_size,
            out_hidden_size=text_hidden,
            fullatt_block_indexes=[vision_depth - 1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(str(out))
    return out
