"""A resume's model weights read once per DP group: each DP rank reads a part, then the parts are broadcast.

Every rank of a module's DP group holds the same weights (the same TP/PP coordinates), so a plain load
makes each of them read the same bytes: at 72B on tp 8 with DP 8, a node reads its 144 GB eight times
over. Here the group's ranks split the module's tensors between them (by bytes, the same split on every
rank), each reads only its share from the checkpoint, and each tensor is then broadcast from its reader
into the parameter of every other rank of the group (on the parameters' own device and group: gloo on
the CPU, NCCL on GPUs), so storage serves each byte once per group. The optimizer state needs none of
this: each DP rank reads only its own shard of it (:mod:`optimizer`, :mod:`reshard`). Neither do a
mixture-of-experts model's expert weights, which differ between the DP ranks of an expert-parallel
module: each rank reads its own experts.

Why not megatron's ``FullyParallelLoadStrategyWrapper``: its exchange allocates CUDA buffers
(``init_data("cuda")``, ``.cuda()``), so it cannot run on the gloo CPU runs the tests use.
"""

from __future__ import annotations

#: a module's keys start with these (``model.model_sharded_state_dict``'s wrapper-free keys)
LANGUAGE_PREFIX, ENCODER_PREFIX = "language_model.", "modality_submodules."


def module_of(key: str) -> str | None:
    if key.startswith(LANGUAGE_PREFIX):
        return "language"
    if key.startswith(ENCODER_PREFIX):
        return key[len(ENCODER_PREFIX):].split(".", 1)[0]
    return None


def split_by_bytes(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """``{key: reader}``: the largest tensor first to the least loaded of ``ranks`` readers (ties: the
    lower rank; keys in sorted order for equal sizes), so every rank computes the same split."""
    loads = [0] * ranks
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        reader = min(range(ranks), key=lambda r: (loads[r], r))
        owner[key] = reader
        loads[reader] += sizes[key]
    return owner


def _parameter(entry):
    """The parameter a sharded entry loads into (a ShardedTensor's or a factory's data), or None."""
    import torch

    data = getattr(entry, "data", None)
    return data if isinstance(data, torch.nn.Parameter) else None


def _as_reader(entry):
    """``entry`` marked as its tensor's main replica on this rank: megatron's load checks that every
    stored chunk is asked for by exactly one main replica, and the model marks only DP rank 0's so."""
    from dataclasses import replace

    rid = entry.replica_id
    return replace(entry, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0)


def plan_spread(sd: dict, groups: dict) -> tuple[dict, list]:
    """``(this rank's part of sd, [(key, parameter, group, source rank)])``: the entries of a module whose
    DP group (``groups``: module name -> process group) has more than one rank are split between its
    ranks; every other entry (objects, buffers, modules not in ``groups``) stays in the part."""
    import torch.distributed as dist

    by_module: dict = {}
    for key, entry in sd.items():
        name = module_of(key)
        group = groups.get(name)
        param = _parameter(entry)
        # an expert parameter (``allreduce`` False) differs between the DP ranks of an expert-parallel
        # module: each rank reads its own experts as in a plain load
        if (group is not None and dist.get_world_size(group) > 1 and param is not None
                and getattr(param, "allreduce", True)):
            by_module.setdefault(name, {})[key] = entry
    part = {k: v for k, v in sd.items() if not any(k in keys for keys in by_module.values())}
    shares = []
    for name in sorted(by_module):
        group, entries = groups[name], by_module[name]
        owner = split_by_bytes({k: _parameter(v).numel() * _parameter(v).element_size() for k, v in entries.items()},
                               dist.get_world_size(group))
        me = dist.get_rank(group)
        for key in sorted(entries):
            if owner[key] == me:
                part[key] = _as_reader(entries[key])
            shares.append((key, _parameter(entries[key]), group, dist.get_global_rank(group, owner[key])))
    return part, shares


def share(shares: list) -> set:
    """Broadcast each spread tensor from its reader into every other rank's parameter (in place; every
    rank of a group runs the same broadcasts in the same order); the keys this rank received."""
    import torch
    import torch.distributed as dist

    received = set()
    me = dist.get_rank()
    with torch.no_grad():
        for key, param, group, source in shares:
            dist.broadcast(param.data, src=source, group=group)
            if source != me:
                received.add(key)
    return received


def any_failed(shares: list, failed: bool) -> bool:
    """Whether any rank of the spread groups failed to read its part (one small all-reduce per group,
    before :func:`share`): a rank that raised must not leave the others waiting in a broadcast."""
    import torch
    import torch.distributed as dist

    seen = []
    out = failed
    for _key, param, group, _source in shares:
        if any(group is g for g in seen):
            continue
        seen.append(group)
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=param.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        out = out or bool(flag.item())
    return out
