"""A vision tower replicated on its tp ranks encodes each micro-batch once between them, not once on each.

Qwen-VL towers are transformers' modules: an ``images`` component with ``tp > 1`` replicates the tower on those
ranks (never shards it), and every one of them used to encode the same images. That is the layout a long clip
meets under language context parallelism on shared GPUs (``language=cp=4`` beside ``images=tp=4``: the cp group's
GPUs are the tower's tp ranks), so the whole clip was encoded -- and its activations kept -- on every GPU of the
group. Here each tp rank's encoder forward (wrapped by :func:`install`) does, every micro-batch:

1. cut the items into units, an image or one temporal patch of a clip (``encoder_plan.temporal_units``; exact:
   the towers attend within a temporal patch and build its positions from ``h, w`` alone);
2. give tp rank ``r`` the contiguous units ``[b_r, b_{r+1})`` whose model patches fill the ``r``-th share of the
   total (:func:`shares`, pure, the same on every rank: the rank's inputs are identical);
3. encode them, and all-gather the outputs over the tp group (one padded ``all_gather``), so every rank holds the
   whole output as before; its backward keeps this rank's rows of the output gradient (identical on every tp
   rank: the language side and the bridge give each replica the whole gradient).

The tower's parameters then hold the gradient of their own units only: they are marked ``tp_partial_grad``, so
``train.step`` sums them over the images tp group after megatron's DP reduction (one coalesced all-reduce).
Tested per parameter against one process (``tests/test_tower_split_e2e.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from mimo_sft.data.reorder.encoder_plan import temporal_units

#: the model patches this rank encoded in the training forwards since the last :func:`take_encoded_patches`
_ENCODED: list[int] = []


def shares(costs: Sequence[float], parts: int) -> list[int]:
    """Boundaries ``b_0 = 0 <= b_1 <= ... <= b_parts = len(costs)``: part ``r`` takes units ``[b_r, b_{r+1})``;
    ``b_r`` is where the running cost is nearest ``r / parts`` of the total (the earlier unit on a tie)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    total, bounds = prefix[-1], [0]
    for r in range(1, parts):
        target = total * r / parts
        i = bounds[-1]
        while i < len(costs) and prefix[i + 1] <= target:
            i += 1
        if i < len(costs) and abs(prefix[i + 1] - target) < abs(prefix[i] - target):
            i += 1
        bounds.append(max(i, bounds[-1]))
    bounds.append(len(costs))
    return bounds


class _GatherRows(torch.autograd.Function):
    """Every tp rank's rows back to back (``counts`` rows each); backward: this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, local, counts: list[int], me: int, group):
        ctx.start, ctx.count = sum(counts[:me]), counts[me]
        width = local.shape[1:]
        padded = local.new_zeros((max(counts), *width))
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.count], None, None, None


def split_forward(encode: Callable, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *, group,
                  temporal: int, merge: int) -> torch.Tensor:
    """The tower's output for all of the micro-batch's items, this rank encoding its share (module docstring)."""
    from mimo_sft.model.pixels import model_grid_thw

    grid = image_grid_thw.cpu()  # the host grid (issue 52): no device read
    units = temporal_units(grid, temporal)
    if units.shape[0] == 0:
        return encode(pixel_values, image_grid_thw)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    patches = [int(p) for p in model_grid_thw(units, temporal).prod(dim=1).tolist()]
    bounds = shares(patches, size)
    rows = [int(r) for r in units.prod(dim=1).tolist()]  # pixel rows per unit
    a, b = bounds[me], bounds[me + 1]
    if torch.is_grad_enabled():  # a training forward: this replica's work (the straggler report's rank_patches)
        _ENCODED.append(sum(patches[a:b]))
    first, last = sum(rows[:a]), sum(rows[:b])
    local = encode(pixel_values[first:last], units[a:b].to(image_grid_thw.dtype))
    counts = [sum(patches[bounds[r]:bounds[r + 1]]) // (merge * merge) for r in range(size)]
    assert local.shape[0] == counts[me], (tuple(local.shape), counts, me)
    return _GatherRows.apply(local, counts, me, group)


def _tp_group(model, pstate):
    """The images module's tp group on this rank when it has more than one rank, else None."""
    from mimo_sft.model.family import IMAGES

    groups = pstate.modules.get(IMAGES)
    if groups is None or not groups.member or IMAGES not in model.modality_submodules:
        return None
    tp = groups.pg_collection.tp
    return tp if tp is not None and dist.get_world_size(tp) > 1 else None


def install(model, pstate, info) -> bool:
    """Wrap the tower's forward on this rank when the images module has ``tp > 1`` (True when it did). Before
    ``--encoder-balance`` wraps it in turn: images first move between the DP group's towers, and the replicas
    then share what each tower got."""
    from mimo_sft.model.family import IMAGES

    tp = _tp_group(model, pstate)
    if tp is None:
        return False
    cfg = info.hf_config.vision_config
    temporal, merge = int(getattr(cfg, "temporal_patch_size", 2)), int(getattr(cfg, "spatial_merge_size", 2))
    for enc in model.modality_submodules[IMAGES].encoders.values():
        encode = enc.forward

        def forward(pixel_values, image_grid_thw, _encode=encode):
            return split_forward(_encode, pixel_values, image_grid_thw, group=tp, temporal=temporal, merge=merge)

        enc.forward = forward
    return True


def mark_partial_grads(model, pstate) -> None:
    """Mark every tower parameter (LoRA's too: call after the adapters exist) ``tp_partial_grad``: each replica
    holds the gradient of its own units, summed over the images tp group by ``train.step``."""
    from mimo_sft.model.family import IMAGES

    if _tp_group(model, pstate) is None:
        return
    for enc in model.modality_submodules[IMAGES].encoders.values():
        for p in enc.parameters():
            p.tp_partial_grad = True


def take_encoded_patches() -> float | None:
    """The model patches this replica encoded in the training forwards since the last call (None: no split
    forward ran)."""
    if not _ENCODED:
        return None
    total = float(sum(_ENCODED))
    _ENCODED.clear()
    return total
