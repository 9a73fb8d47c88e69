"""The data's heaviest micro-batch, measured at real width: what autograd keeps for it, against the forecast.

Why: check 23 forecasts the largest micro-batch a dataset's rows can form (``memory.from_data``) from their
per-row counts. Its activation terms are held to what the real layers keep for that micro-batch: the ``B`` rows
with the most real tokens (language; one packed sequence of them with in-batch packing, else ``B`` padded rows)
and the ``B`` rows with the most patches (vision: their images' windows in the windowed blocks, whole images
(frame groups) in the others, as transformers' tower lays them out). Each kind of layer is measured once at the
checkpoint's real width (``testing.saved_bytes``: distinct storages autograd saves, on the CPU, flash SDPA) and
multiplied by how many of that kind the model has, as the forecast composes it; the patch merger (and Qwen3-VL's
DeepStack mergers) once.

Used by ``tests/test_memory_data.py`` and ``scripts/bench_memory_data.py``; not part of training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class WorstBatch:
    """The rows of the heaviest micro-batch on one rank of each module, and their shapes."""

    token_rows: list[int]      # rows (over every source, in order) with the most real tokens
    lengths: list[int]         # their real tokens
    patch_rows: list[int]      # rows with the most patches
    grids: list[list[int]]     # their images' [t, h, w]


def worst_batch(counts, *, language_rows: int, vision_rows: int) -> WorstBatch:
    """The ``language_rows`` rows of ``counts`` (``memory.from_data.RowCounts``) with the most real tokens and the
    ``vision_rows`` rows with the most image tokens (distinct rows: the micro-batch the data forms)."""
    tokens = np.concatenate([s.tokens for s in counts.sources]).astype(np.int64)
    images = np.concatenate([s.image_tokens for s in counts.sources]).astype(np.int64)
    starts = np.cumsum([0] + [len(s) for s in counts.sources])
    by_tokens = [int(i) for i in np.argsort(-tokens, kind="stable")[:language_rows]]
    by_images = [int(i) for i in np.argsort(-images, kind="stable")[:vision_rows]]
    grids = []
    for row in by_images:
        k = int(np.searchsorted(starts, row, side="right")) - 1
        src = counts.sources[k]
        grids += [[int(x) for x in g] for g in src.grids[src.image_rows == row - starts[k]]]
    return WorstBatch(by_tokens, [int(tokens[i]) for i in by_tokens], by_images, grids)


def language_saved(hf_dir: str, batch: WorstBatch, *, dtype: torch.dtype, device: str, packed: bool,
                   seq_length: int) -> int:
    """What the decoder keeps for the micro-batch: each layer kind measured once on it, times its layers."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import TextDims
    from mimo_sft.testing import saved_bytes as sb

    d = TextDims.from_config(read_hf_config(hf_dir))
    kinds = list(d.layer_types) or [None]
    total = 0
    for kind in sorted(set(kinds), key=str):
        block, cfg = sb.language_layer(hf_dir, dtype=dtype, layer_type=kind)
        if packed:
            one = sb.language_layer_saved(block, cfg, sum(batch.lengths), dtype=dtype, device=device,
                                          segments=batch.lengths)
        else:
            one = sb.language_layer_saved(block, cfg, seq_length, dtype=dtype, device=device, batch=len(batch.lengths))
        total += one * (kinds.count(kind) if kind is not None else d.layers)
    return total


def vision_saved(hf_dir: str, batch: WorstBatch, *, dtype: torch.dtype) -> int:
    """What the tower's blocks and mergers keep for the micro-batch's images: a windowed block (over the images'
    windows) and a full-attention block (over whole images) measured once each, times their blocks."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import VisionDims
    from mimo_sft.testing import saved_bytes as sb

    v = VisionDims.from_config(read_hf_config(hf_dir))
    block, vcfg = sb.vision_block(hf_dir, dtype=dtype)
    windows, images = sb.image_segments(vcfg, batch.grids)
    patches = sum(images)
    full = sb.vision_block_saved(block, vcfg, patches, dtype=dtype, segments=images)
    total = full * v.full_attention_blocks
    if v.depth > v.full_attention_blocks:
        windowed = sb.vision_block_saved(block, vcfg, patches, dtype=dtype, segments=windows)
        total += windowed * (v.depth - v.full_attention_blocks)
    x = torch.randn(patches, v.hidden, dtype=dtype, requires_grad=True)
    for j, merger in enumerate(sb.projector_modules(hf_dir, dtype=dtype)):
        # the main merger's input is the last block's output, kept by it alone; a DeepStack merger's is a block
        # output the next block keeps anyway (counted there)
        kept, _ = sb.saved_bytes(merger, x, exclude=list(merger.parameters()) + ([x] if j else []))
        total += kept
    return total
