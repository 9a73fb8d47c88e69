"""The reshardable optimizer form without a gather: each DP rank writes its own shard as boxes.

megatron's ``fully_reshardable`` form stores each parameter's fp32 main weight and Adam moments as
tensors of the parameter's own (global) shape, keyed ``optimizer.state.{param,exp_avg,exp_avg_sq}.<the
parameter's key>``, so any TP/PP/DP layout can read its part. megatron builds them by gathering the
flat DP shards of a module's whole TP/PP-local state on *every* DP rank (an NCCL/gloo all-gather into
host buffers: at 72B on tp 8, 9B parameters x 12 bytes = 109 GB on each rank, all eight ranks of a node
at once), and each rank loads that whole TP/PP-local state back before slicing out its shard.

Here the same tensors are written in pieces instead. A DP rank's shard of a parameter is one flat
range ``[start, stop)`` of the parameter's TP-local tensor (row-major); such a range is the union of a
few rectangular boxes (:func:`flat_boxes`: a partial first row, whole rows, a partial last row, one
level down per dimension), each a contiguous slice of the shard. Each box is written as a chunk of the
parameter-shaped tensor (megatron's ShardedTensor with an irregular grid, which its torch-dist format
hands to torch's distributed checkpoint as is), straight from the optimizer's own tensors: no gather,
no copy, every rank in parallel. Loading asks for this rank's boxes only, so it reads its own shard,
from a checkpoint written this way or by megatron's gather (the same keys and shapes; torch's reader
takes the overlap of the stored and the asked-for chunks). What megatron-core 0.19.2's gather stores is
shifted past a module's first padded gradient bucket (:mod:`optimizer`); these boxes are not: each
one is placed by the parameter's own range (tests/test_checkpoint_scale.py assembles the stored
tensors from every rank's shard by brute force).

A parameter the model describes with a factory (fc1's ``[gate; up]``, a Gated DeltaNet's in_proj
sections) is stored under the factory's built keys. Which element of the TP-local tensor lands where is
learnt by building the factory on a tensor of element numbers (:func:`_factory_plan`; its pieces are
slices, so runs of consecutive numbers map to boxes), once per parameter and shard.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

import torch

#: what megatron's fully_reshardable form stores per parameter (its ``("param",) + optimizer_state_keys``)
STATE_PREFIX = "optimizer.state"


def flat_boxes(shape: tuple, start: int, stop: int) -> list[tuple[tuple, tuple, int]]:
    """Rectangular boxes ``(offset, size, flat start)`` whose union is the row-major flat range
    ``[start, stop)`` of a tensor of ``shape``, in flat order; each box is one contiguous flat range.
    At most ``2 * len(shape) - 1`` boxes."""
    if stop <= start:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = prod(shape[1:])
    if inner == 0:
        return []
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = tuple(shape[1:])
    if r0 == r1:  # inside one row
        return [((r0, *off), (1, *size), r0 * inner + flat) for off, size, flat in flat_boxes(rest, c0, c1)]
    out = []
    if c0:
        out += [((r0, *off), (1, *size), r0 * inner + flat) for off, size, flat in flat_boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest), r0 * inner))
    if c1:
        out += [((r1, *off), (1, *size), r1 * inner + flat) for off, size, flat in flat_boxes(rest, 0, c1)]
    return out


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """``[(first, last + 1)]`` of the runs of consecutive values in a sorted 1-D tensor."""
    if positions.numel() == 0:
        return []
    breaks = torch.nonzero(positions[1:] - positions[:-1] != 1).flatten().tolist()
    starts = [0] + [b + 1 for b in breaks]
    ends = [b + 1 for b in breaks] + [positions.numel()]
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts, ends)]


def _tensor_plan(sh, start: int, stop: int, numbers=None) -> list[tuple]:
    """``(key suffix, global shape, box offset, box size, source)`` of one ShardedTensor ``sh`` for the shard
    ``[start, stop)`` of the parameter; ``source`` is ``(a, b)``, a slice of the flat shard, or a LongTensor of
    shard positions. ``numbers``: the element numbers ``sh`` holds (a factory's piece); None: ``sh`` is
    the parameter itself."""
    full = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    base = tuple(sh.global_offset)
    if numbers is None:
        spans = [(start, stop, None)]
    else:
        flat = numbers.reshape(-1)
        inside = torch.nonzero((flat >= start) & (flat < stop)).flatten()
        spans = [(a, b, flat) for a, b in _runs(inside)]
    plan = []
    for a, b, flat in spans:
        for off, size, first in flat_boxes(full, a, b):
            n = prod(size)
            if flat is None:
                source = (first - start, first - start + n)
            else:
                values = flat[first:first + n].to(torch.long) - start
                consecutive = bool(n == 1 or torch.all(values[1:] - values[:-1] == 1))
                source = (int(values[0]), int(values[0]) + n) if consecutive else values
            plan.append((sh.key, tuple(sh.global_shape), tuple(o + p for o, p in zip(base, off)), size, source,
                         sh.allow_shape_mismatch))
    return plan


def _factory_plan(factory, start: int, stop: int) -> list[tuple]:
    """The plan of a ShardedTensorFactory: its pieces built on element numbers (see the module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    shape = tuple(factory.data.shape)
    numel = prod(shape)
    numbers = torch.arange(numel, dtype=torch.int32 if numel < 2 ** 31 else torch.long).view(shape)
    built = replace(factory, data=numbers).build()
    plan = []
    for piece in nested_values(built):
        plan += _tensor_plan(piece, start, stop, numbers=piece.data)
    return plan


def _plan(opt, model_param, sharded, start: int, stop: int) -> list[tuple]:
    """Cached per optimizer and parameter (a layer-stacked key names every layer's parameter): the
    layout, hence each shard's boxes, is fixed for a run."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    cache = opt.__dict__.setdefault("_mimo_sft_box_plans", {})
    key = (id(model_param), start, stop)
    if key not in cache:
        if isinstance(sharded, ShardedTensorFactory):
            cache[key] = _factory_plan(sharded, start, stop)
        else:
            assert sharded.flattened_range is None, sharded.key
            cache[key] = _tensor_plan(sharded, start, stop)
    return cache[key]


def _shards(opt):
    """``(model parameter, start, stop)`` of every parameter range this DP rank's optimizer owns, in
    megatron's order (buffers, buckets, parameters)."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for maps in gbuf_range_maps.values():
            for gbuf_range_map in maps:
                for model_param, ranges in gbuf_range_map["param_map"].items():
                    rng = ranges["param"]
                    if rng.end > rng.start:
                        yield model_param, rng.start, rng.end


def _state_keys(opt) -> tuple:
    return ("param",) + tuple(opt.optimizer_state_keys)


def _replica_id(sharded):
    """The parameter's replica id with its DP coordinate 0: every DP rank writes its own boxes, a TP
    (or PP) replica's boxes are written once, as megatron's fully sharded model-space form does."""
    rid = sharded.replica_id
    assert isinstance(rid, tuple) and len(rid) == 3, f"{sharded.key}: replica id {rid} is not (PP, TP, DP)"
    return (rid[0], rid[1], 0)


def _param_map(model_sharded_state_dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {sh.data: sh for sh in nested_values(tensors)}


def sharded_param_state_boxes(opt, model_sharded_state_dict, is_loading: bool) -> tuple[dict, list]:
    """``(param_state, loads)``: this rank's boxes of every state tensor as megatron ShardedTensors
    (``{index: {state key: [ShardedTensor]}}``, in place of megatron's fully_reshardable ``param_state``),
    and (``is_loading``) ``[(model parameter, {state key: flat buffer}, plan)]`` the boxes are loaded into.

    Saving, each box's data is a view of the optimizer's own fp32 tensor (a copy only where a state
    tensor is not fp32, or a factory's piece is not a slice); loading, a view of a fresh flat buffer."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    by_param = _param_map(model_sharded_state_dict)
    state, loads = {}, []
    for index, (model_param, start, stop) in enumerate(_shards(opt)):
        sharded = by_param.get(model_param)
        if sharded is None:
            raise ValueError(f"a parameter of shape {tuple(model_param.shape)} is not in the model's sharded state dict")
        plan = _plan(opt, model_param, sharded, start, stop)
        if is_loading:
            flats = {k: torch.empty(stop - start, dtype=torch.float32) for k in _state_keys(opt)}
            loads.append((model_param, flats, plan))
        else:
            own = opt._get_main_param_and_optimizer_states(model_param)
            flats = {k: own[k].detach().reshape(-1).to(torch.float32) for k in _state_keys(opt)}
        rid = _replica_id(sharded)
        entry = {}
        for state_key, flat in flats.items():
            boxes = []
            for key, gshape, offset, size, source, mismatch in plan:
                data = (flat[source[0]:source[1]] if isinstance(source, tuple) else
                        (torch.empty(len(source)) if is_loading else flat[source])).view(size)
                boxes.append(ShardedTensor(f"{STATE_PREFIX}.{state_key}.{key}", data, data.dtype, tuple(size), gshape,
                                           offset, None, replica_id=rid, allow_shape_mismatch=mismatch))
            entry[state_key] = boxes
        state[index] = entry
    return state, loads


def load_param_state_boxes(opt, loaded: dict, loads: list) -> None:
    """Put the loaded boxes (:func:`sharded_param_state_boxes`' ``param_state`` as the load returned it)
    into their flat buffers, then into the optimizer: main weights and Adam moments of this rank's shard."""
    for index, (model_param, flats, plan) in enumerate(loads):
        for state_key, flat in flats.items():
            boxes = loaded[index][state_key]
            assert len(boxes) == len(plan), (state_key, len(boxes), len(plan))
            for box, (*_where, source, _mismatch) in zip(boxes, plan):
                if isinstance(source, tuple):
                    dst = flat[source[0]:source[1]]
                    if dst.data_ptr() != box.data_ptr():  # the reader filled a buffer of its own
                        dst.copy_(box.reshape(-1))
                else:
                    flat[source] = box.reshape(-1).to(flat.dtype)
        with torch.no_grad():
            opt._set_main_param_and_optimizer_states(model_param, flats)


class boxes_for_reshardable:
    """While active, megatron's ``fully_reshardable`` map of each distributed optimizer in ``optimizers``
    is this module's boxes (megatron's ``sharded_state_dict`` keeps the rest of its form: the common
    state as plain values). A load's flat buffers are kept on each optimizer for
    :func:`load_param_state_boxes` (``opt._mimo_sft_box_loads``)."""

    ATTR = "sharded_param_state_fully_reshardable"

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def __enter__(self):
        for opt in self.optimizers:
            def boxes(model_sharded_state_dict, is_loading=False, metadata=None, _opt=opt):
                state, loads = sharded_param_state_boxes(_opt, model_sharded_state_dict, is_loading)
                _opt._mimo_sft_box_loads = loads
                return state

            setattr(opt, self.ATTR, boxes)  # an instance attribute: the class's method is untouched
        return self

    def __exit__(self, *_exc):
        for opt in self.optimizers:
            opt.__dict__.pop(self.ATTR, None)
        return False
