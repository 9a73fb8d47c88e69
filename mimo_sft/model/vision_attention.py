"""Vision-tower attention: one SDPA call per block, registered through transformers' attention interface.

Why: transformers 5.23's Qwen-VL vision attention (``Qwen2_5_VLVisionAttention``,
``Qwen3VLVisionAttention``, ...) splits q/k/v by ``cu_seqlens`` and calls its attention function
once per window or image, after ``lengths.tolist()`` (a device sync) in every block -- unless the
configured implementation is a "flash" one, in which case it makes one call with
``cu_seq_lens_q/k`` and ``max_length_q/k``. :data:`SEGMENT_ATTENTION` is such an implementation
(its name contains "flash" for that reason only), registered in ``ALL_ATTENTION_FUNCTIONS``: it runs
``model.segments.SegmentBatch.attend`` -- every window (windowed blocks) or every image
(full-attention blocks) of the micro-batch as one padded batch with a key mask, one
``scaled_dot_product_attention`` call, torch only, the same code on CPU and GPU.

Any transformers vision tower whose attention takes that flash branch gets it by setting
``config._attn_implementation = SEGMENT_ATTENTION``; transformers' init-time check would try to load
a flash-attn kernel for a "flash" name, so the tower class mixes in :class:`SegmentAttentionTower`,
which accepts the name as it is. The segment layout is read from ``cu_seqlens`` once per tensor
(all blocks share it); a tower that computes its bounds on the host attaches them
(:func:`host_vision_kwargs` does for Qwen2.5-VL's windowed tower, :func:`host_interpolated_kwargs` for the
Qwen3-VL and Qwen3.5 towers), and then nothing inside the tower reads the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from mimo_sft.model.segments import attach_segments, host_to, segments_of

#: the transformers attention implementation name (``config._attn_implementation``)
SEGMENT_ATTENTION = "mimo_segments_flash_api"


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                              dropout: float = 0.0, is_causal: Optional[bool] = None,
                              cu_seq_lens_q: Optional[torch.Tensor] = None, cu_seq_lens_k: Optional[torch.Tensor] = None,
                              **kwargs):
    """transformers' attention-function contract: ``query [1, heads, N, d]`` (keys alike) -> ``([1, N, heads, d],
    None)``; segments from ``cu_seq_lens_q`` (== ``cu_seq_lens_k``: self-attention over the same segments)."""
    assert attention_mask is None, f"{SEGMENT_ATTENTION}: vision attention takes cu_seqlens, not a mask"
    assert cu_seq_lens_q is not None, f"{SEGMENT_ATTENTION}: the tower passed no cu_seqlens"
    assert cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q or cu_seq_lens_k.shape == cu_seq_lens_q.shape, (
        f"{SEGMENT_ATTENTION}: self-attention needs the same segments for queries and keys")
    assert not (module.training and dropout > 0), f"{SEGMENT_ATTENTION}: attention dropout {dropout} is not supported"
    assert query.shape[0] == 1, f"{SEGMENT_ATTENTION}: packed input has batch 1, got {query.shape[0]}"
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, d]
    out = segments_of(cu_seq_lens_q, q.device).attend(q, k, v, causal=bool(is_causal), scale=scaling)
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention_forward)


_register()


class SegmentAttentionTower:
    """Mixin for a transformers vision tower class: lets ``config._attn_implementation`` be
    :data:`SEGMENT_ATTENTION` (transformers would otherwise look for a flash-attn kernel by that name)."""

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check: bool = False,
                                              allow_all_kernels: bool = False):
        if attn_implementation == SEGMENT_ATTENTION:
            return attn_implementation
        return super()._check_and_adjust_attn_implementation(attn_implementation, is_init_check=is_init_check,
                                                              allow_all_kernels=allow_all_kernels)


def host_vision_kwargs(grid_thw: torch.Tensor, config, device: torch.device) -> dict:
    """Everything transformers' Qwen2.5-VL tower derives from ``grid_thw`` -- rotary positions, window
    order, window and image bounds with their longest lengths -- computed from a host ``grid_thw`` and
    handed to the tower as its documented precomputed kwargs (``transformers.vision_utils``), with each
    bound's segment layout attached: the tower then never reads the device (its own path calls
    ``grid_thw.tolist()`` twice and, with a flash implementation, ``.max().item()`` twice)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    grid = grid_thw.cpu()
    window_index, cu_window = get_vision_window_index(grid, spatial_merge_size=config.spatial_merge_size,
                                                      window_size=config.window_size, patch_size=config.patch_size)
    cu_full = get_vision_cu_seqlens(grid)
    positions = get_vision_position_ids(grid, config.spatial_merge_size)
    host = dict(position_ids=positions, window_index=window_index, cu_window_seqlens=cu_window, cu_seqlens=cu_full)
    moved = {name: host_to(t, device) for name, t in host.items()}
    for name in ("cu_window_seqlens", "cu_seqlens"):
        attach_segments(moved[name], host[name].tolist())
    moved["max_seqlen"] = int((cu_full[1:] - cu_full[:-1]).max())
    moved["max_window_seqlen"] = int((cu_window[1:] - cu_window[:-1]).max())
    return moved


def host_interpolated_kwargs(grid_thw: torch.Tensor, tower, device: torch.device) -> dict:
    """Everything transformers' Qwen3-VL and Qwen3.5 towers derive from ``grid_thw`` -- the learned position
    table's interpolation indices and weights, the rotary positions, the image (or frame) bounds and the
    longest of them -- computed from a host ``grid_thw`` and handed to the tower as its documented precomputed
    kwargs, each moved to ``device`` once (asynchronously).

    Why: given the grid alone, the tower builds its indices on the grid's device. A host grid (what training
    hands it) then puts a host index into ``pos_embed`` on the GPU -- "index is on cpu", the first H200 run's
    crash -- and a device grid costs a ``tolist()`` and an ``.item()`` (device syncs) per forward. Here the
    same transformers functions run on the host, so the values are the tower's own, bit for bit."""
    from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                           get_vision_position_ids)

    grid = grid_thw.cpu()
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
    cu_seqlens = get_vision_cu_seqlens(grid)
    host = dict(interp_indices=indices, interp_weights=weights, cu_seqlens=cu_seqlens,
                position_ids=get_vision_position_ids(grid, tower.spatial_merge_size))
    moved = {name: host_to(t, device) for name, t in host.items()}
    attach_segments(moved["cu_seqlens"], cu_seqlens.tolist())
    moved["max_seqlen"] = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return moved

