"""Reading a part of a checkpoint's model weights: one decoder layer at a time, for the streamed export.

Why not ``megatron.core.dist_checkpointing.load``: megatron turns each of its ``ShardedTensor`` keys
into a torch ``ShardedTensor`` whose metadata describes every fragment of the grid and places the
fragments this rank lacks on "another rank", ``(rank + 1) % world_size`` -- rank 0 itself in the
1-rank world export runs in, so a part (one layer of the layer-stacked tensors) fails torch's
local-shard count, and torch's ``ShardedTensor`` insists on covering the whole tensor. Here torch's
distributed-checkpoint reader (the format megatron's ``torch_dist`` strategy writes) is given a load
planner that asks for the requested regions only (``create_read_items_for_chunk_list``, torch's own
resharding arithmetic), so it reads the stored chunks that overlap them and nothing else. megatron's
factories (fc1's ``[gate; up]``) are built and merged by megatron's own functions.
"""

from __future__ import annotations

import os

import torch

from mimo_sft.errors import UserError


def _leaves(node, out: list) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(node, ShardedTensor):
        out.append(node)
    elif isinstance(node, dict):
        for value in node.values():
            _leaves(value, out)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _leaves(value, out)
    else:
        raise AssertionError(f"unexpected {type(node).__name__} in a model's sharded state dict part")


def _values(node):
    """The sharded structure with each ``ShardedTensor`` replaced by its (now loaded) data."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(node, ShardedTensor):
        return node.data
    if isinstance(node, dict):
        return {k: _values(v) for k, v in node.items()}
    return [_values(v) for v in node]


def _regions(tensors: list) -> dict:
    """``{checkpoint key: [(global offset, host buffer of the region)]}`` for megatron ``ShardedTensor``s
    (their prepended layer axis made explicit)."""
    regions: dict[str, list] = {}
    for sh in tensors:
        assert sh.flattened_range is None, f"{sh.key}: flattened model weights are not expected"
        view = sh.data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        regions.setdefault(sh.key, []).append((tuple(sh.global_offset), view))
    return regions


def _region_planner(regions: dict):
    """A torch DCP load planner that reads exactly ``regions`` (and fills their buffers in place)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    global _RegionPlanner
    if _RegionPlanner is None:
        # one class for the process (held as an instance attribute, the buffers are freed with the
        # planner; a class made per call is cyclic garbage that keeps a layer alive until a full GC)
        class RegionPlanner(DefaultLoadPlanner):
            def create_local_plan(self) -> LoadPlan:
                items = []
                for key, parts in self.regions.items():
                    stored = self.metadata.state_dict_metadata.get(key)
                    if stored is None:
                        raise KeyError(f"tensor {key} is not in the checkpoint")
                    chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=buf.shape) for off, buf in parts]
                    items += create_read_items_for_chunk_list(key, stored, chunks)
                return LoadPlan(items)

            def lookup_tensor(self, index):
                return next(buf for off, buf in self.regions[index.fqn] if off == tuple(index.offset))

        _RegionPlanner = RegionPlanner
    planner = _RegionPlanner()
    planner.regions = regions
    return planner


_RegionPlanner = None


def read_model_part(part: dict, folder: str) -> dict:
    """``part``: ``{state_dict key: megatron ShardedTensor or ShardedTensorFactory}`` of a model (its
    ``data`` host buffers of the local shapes); returns ``{state_dict key: tensor}`` read from the
    dist-checkpoint ``folder``."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factory_merges

    from mimo_sft.train.checkpoint.trusted import trusted_part, trusted_reader

    built = {k: (v.build() if isinstance(v, ShardedTensorFactory) else v) for k, v in part.items()}
    tensors: list = []
    _leaves(built, tensors)
    trusted_part(folder)  # a refusal is its own one line, not wrapped in torch's CheckpointException
    try:
        regions = _regions(tensors)
        dcp.load({}, storage_reader=trusted_reader(folder), planner=_region_planner(regions), no_dist=True)
    except (KeyError, OSError, RuntimeError, ValueError) as err:  # torch wraps a missing key or a bad file in CheckpointException
        first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else ""
        raise UserError(f"checkpoint {os.path.dirname(folder)}: weights {sorted(part)[:2]} cannot be read "
                        f"({type(err).__name__}: {first}); was it saved from another model?") from None
    factories = {k: v for k, v in part.items() if isinstance(v, ShardedTensorFactory)}
    return apply_factory_merges(_values(built), factories)
