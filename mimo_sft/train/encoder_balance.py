"""``--encoder-balance``: images (and a clip's temporal patches) encoded on the least-loaded tower of the vision DP
group, embeddings sent back.

On a colocated layout every GPU encodes its own slice's images. Sample placement (``--intra-microbatch-reorder``)
balances whole samples; a sample of several large pages still lands on one tower. Here each vision DP rank's
encoder forward (its instance's ``forward``, wrapped by :func:`install`) does, every micro-batch:

1. gather every rank's image grids over the group's gloo copy (two small all-gathers: counts, then grids), and
   cut each clip into its temporal patches (``encoder_plan.temporal_units``: one long clip spreads over towers);
2. plan (``data.reorder.encoder_plan``, pure): every rank computes the same destinations;
3. send the pixel rows of the images that move (one ragged ``all_to_all_single``; uint8 as the data path
   carries them), encode what arrived, and send each image's output rows back to its own rank (one more
   ``all_to_all_single``, an autograd function: its backward sends the gradients the reverse way);
4. put the rows back in the rank's own image order, so MimoModel scatters them as before.

Every rank of the group takes part in every micro-batch, with or without images of its own (the model's
``modality_inputs`` pass zero images on, see ``model.family``); when no rank has an image, or the plan moves
nothing, no pixel crosses. Gradients: each tower's parameters get the gradients of the images it encoded and
DDP sums them over the vision DP group, as before -- the step is the one without balancing (tested per
parameter against one process). Colocated layouts with equal DP sizes only (check 11).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from mimo_sft.data.reorder.encoder_plan import encoder_destinations, spread, temporal_units, tower_loads

#: per micro-batch since the last :func:`take_step_figures`: (images moved, spread before, spread after)
_SEEN: list[tuple[int, float | None, float | None]] = []
#: the model patches this rank's tower encoded in the training forwards since the last :func:`take_encoded_patches`
_ENCODED: list[float] = []


class _Exchange(torch.autograd.Function):
    """Rows to other ranks (``send`` rows to each, ``recv`` rows from each); the backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


#: the pixel rows' dtypes a rank may carry (uint8: the data path's; float: transformers' patches), by code
_DTYPES = (torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _gather_grids(grid: torch.Tensor, width: int, dtype: torch.dtype, gloo) -> tuple[list[torch.Tensor], int, torch.dtype]:
    """Every rank's ``[n_r, 3]`` grid (host), and the pixel rows' width and dtype of the ranks holding images (a
    rank without one passes an empty placeholder); ranks whose rows differ in either are refused, on every rank."""
    size = dist.get_world_size(gloo)
    head = torch.tensor([grid.shape[0], width, _DTYPES.index(dtype)], dtype=torch.int64)
    heads = [torch.empty_like(head) for _ in range(size)]
    dist.all_gather(heads, head, group=gloo)
    n_max = max(int(h[0]) for h in heads)
    padded = torch.zeros((n_max, 3), dtype=torch.int64)
    padded[:grid.shape[0]] = grid.to(torch.int64)
    grids = [torch.empty_like(padded) for _ in range(size)]
    if n_max:
        dist.all_gather(grids, padded, group=gloo)
    widths = {int(h[1]) for h in heads if int(h[0])}
    kinds = {int(h[2]) for h in heads if int(h[0])}
    if len(widths) > 1 or len(kinds) > 1:
        raise RuntimeError(f"--encoder-balance: the vision ranks carry pixel rows of different widths/dtypes "
                           f"{[(int(h[1]), str(_DTYPES[int(h[2])])) for h in heads]}")
    return ([g[:int(h[0])] for g, h in zip(grids, heads)], widths.pop() if widths else width,
            _DTYPES[kinds.pop()] if kinds else dtype)


class Routes(NamedTuple):
    """Where this rank's images go and what it gets (pure arithmetic on the gathered grids and the plan)."""

    send_order: list[int]        # my images, grouped by destination rank (index order inside)
    send_rows: list[int]         # pixel rows to each rank
    recv_rows: list[int]         # pixel rows from each rank
    arrived: list[tuple[int, int]]  # (rank, image) encoded here, in the order they arrive
    back_send: list[int]         # output rows returned to each rank
    back_recv: list[int]         # output rows of my images coming back from each rank
    rows: list[int]              # my images' pixel rows
    out_rows: list[int]          # my images' output rows


def routes(grids: list[torch.Tensor], costs: list[list[float]], dest: list[list[int]], me: int, *,
           merge: int) -> Routes:
    """``costs``: each image's model patches (the plan's costs), so its output rows are ``costs / merge**2``."""
    size = len(grids)
    rows = [[int(x) for x in g.prod(dim=1).tolist()] for g in grids]  # pixel rows per image, per rank
    out = [[int(c) // (merge * merge) for c in cs] for cs in costs]  # output rows per image
    mine = dest[me]
    send_order = [i for q in range(size) for i in range(len(mine)) if mine[i] == q]
    arrived = [(r, i) for r in range(size) for i in range(len(dest[r])) if dest[r][i] == me]
    return Routes(send_order=send_order,
                  send_rows=[sum(rows[me][i] for i in range(len(mine)) if mine[i] == q) for q in range(size)],
                  recv_rows=[sum(rows[r][i] for (r2, i) in arrived if r2 == r) for r in range(size)],
                  arrived=arrived,
                  back_send=[sum(out[r][i] for (r2, i) in arrived if r2 == r) for r in range(size)],
                  back_recv=[sum(out[me][i] for i in range(len(mine)) if mine[i] == q) for q in range(size)],
                  rows=rows[me], out_rows=out[me])


def _ranges(order: list[int], lengths: list[int], device) -> torch.Tensor:
    """Row indices of items ``order`` of a tensor holding items of ``lengths`` back to back."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in order]).to(device)


def balanced_forward(encode: Callable, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *, group, gloo,
                     temporal: int, merge: int) -> torch.Tensor:
    """The encoder's output for this rank's images, each encoded on the tower the plan names (module docstring)."""
    from mimo_sft.model.pixels import model_grid_thw

    grids, width, dtype = _gather_grids(image_grid_thw.cpu(), int(pixel_values.shape[1]) if pixel_values.dim() == 2 else 0,
                                        pixel_values.dtype, gloo)
    grids = [temporal_units(g, temporal) for g in grids]  # a clip's temporal patches are units of their own
    me = dist.get_rank(gloo)
    costs = [[float(p) for p in model_grid_thw(g, temporal).prod(dim=1).tolist()] if g.numel() else [] for g in grids]
    dest = encoder_destinations(costs)
    moved = sum(d != r for r, ds in enumerate(dest) for d in ds)
    _SEEN.append((moved, spread(tower_loads(costs)), spread(tower_loads(costs, dest))))
    if torch.is_grad_enabled():  # a training forward: what this tower encodes (the straggler report's rank_patches)
        _ENCODED.append(sum(c for r, cs in enumerate(costs) for c, d in zip(cs, dest[r]) if d == me))
    if not moved:
        return encode(pixel_values, image_grid_thw)
    rt = routes(grids, costs, dest, me, merge=merge)
    device = pixel_values.device
    outgoing = (pixel_values.reshape(-1, width).index_select(0, _ranges(rt.send_order, rt.rows, device)).to(dtype)
                if rt.send_order else torch.empty((0, width), dtype=dtype, device=device))
    incoming = _all_to_all(outgoing, rt.send_rows, rt.recv_rows, group)
    in_grid = (torch.stack([grids[r][i] for r, i in rt.arrived]) if rt.arrived
               else torch.zeros((0, 3), dtype=torch.int64)).to(image_grid_thw.dtype)
    returned = _Exchange.apply(encode(incoming, in_grid), rt.back_send, rt.back_recv, group)  # in send order
    if not rt.rows:
        return returned
    sent = [rt.out_rows[i] for i in rt.send_order]  # the returned rows, image by image in send order
    where = {i: k for k, i in enumerate(rt.send_order)}
    return returned.index_select(0, _ranges([where[i] for i in range(len(rt.rows))], sent, returned.device))


def install(model, pstate, info) -> None:
    """Wrap the vision tower's forward of this rank (a member of the images module) for ``--encoder-balance``."""
    from mimo_sft.model.family import IMAGES

    groups = pstate.modules.get(IMAGES)
    if groups is None or not groups.member or IMAGES not in model.modality_submodules:
        return
    cfg = info.hf_config.vision_config
    temporal, merge = int(getattr(cfg, "temporal_patch_size", 2)), int(getattr(cfg, "spatial_merge_size", 2))
    for enc in model.modality_submodules[IMAGES].encoders.values():
        encode = enc.forward

        def forward(pixel_values, image_grid_thw, _encode=encode):
            return balanced_forward(_encode, pixel_values, image_grid_thw, group=groups.pg_collection.dp,
                                    gloo=groups.dp_gloo, temporal=temporal, merge=merge)

        enc.forward = forward


def take_encoded_patches() -> float | None:
    """The model patches this rank's tower encoded in the training forwards since the last call (None: no balanced
    forward ran), so that ``rank_patches`` counts the tower's work, not the slice it was handed."""
    if not _ENCODED:
        return None
    total = math.fsum(_ENCODED)
    _ENCODED.clear()
    return total


def take_step_figures() -> dict[str, float]:
    """The metrics rank's figures of the micro-batches since the last call (every rank computed the same plan):
    ``encoder_balance_moved_images`` (sum), the heaviest tower over the mean before and after (means)."""
    seen = list(_SEEN)
    _SEEN.clear()
    if not seen:
        return {}
    out: dict[str, float] = {"encoder_balance_moved_images": float(sum(m for m, _, _ in seen))}
    for j, when in ((1, "before"), (2, "after")):
        values = [s[j] for s in seen if s[j] is not None]
        if values:
            out[f"encoder_balance_max_over_mean_{when}"] = math.fsum(values) / len(values)
    return out
