"""The optimizer's state as a megatron dist-checkpoint (``iter_N/optimizer/``).

Every module's optimizer (plain or distributed, fp32 or bf16) describes its state with
``MimoOptimizer.sharded_state_dict``. A plain optimizer's Adam moments are sharded tensors keyed by
the model parameter they belong to: layout-free. A distributed optimizer's state is written in one
of three forms (``meta.json``'s ``distributed_optimizer_format``):

* ``dp_reshardable`` (the default): each rank writes its own shard of the flat buffers (fp32 main
  weights, Adam moments), as it holds them: no gather, no copy, every rank in parallel; a resume
  reads only its own shard. Loads on any DP size, colocated or not, but only with each module's TP
  and PP as saved (the buffers follow the TP/PP-local parameters) -- :func:`check_resumable`.
* ``fully_reshardable_boxes`` (``--save-reshardable``): each parameter's main weight and moments as
  tensors of the parameter's shape (the tensors and keys of megatron's ``fully_reshardable``), each DP
  rank writing its own shard of them as boxes and reading back only its own (:mod:`reshard`): resumes on
  any layout, with no gather and no copy, saved and loaded in parallel like the DP-only form.
* ``fully_reshardable`` (read only: what ``--save-reshardable`` wrote before): megatron's own form,
  built by gathering a module's whole TP/PP-local state on every DP rank (109 GB per rank at 72B on tp
  8). Read as boxes like the form above (the same tensors). In megatron-core 0.19.2 the gather
  stores the state of every parameter after a module's first padded gradient bucket shifted by the
  padding before it (it indexes the padded buffer into a concatenation without the padding; its own
  load slices correctly, so the shift is not undone): such a checkpoint resumes exactly only where each
  module had one gradient bucket (check 24 says so).

What megatron leaves as "common" state (the plain optimizers' shared Adam ``step``) would be
written by rank 0 only -- in a non-colocated run rank 0 holds no encoder, so the encoder's step
would be lost. Each module's common part is therefore saved as one more object of its own
(``optimizer.mimo.<module>.common``), written by the module's rank (tp 0, pp 0, dp 0).

The model sharded state dict the optimizer's map is built from must hold the very parameter
objects the optimizer steps: the wrapper-free one of ``model.model_sharded_state_dict``.
"""

from __future__ import annotations

import os

from mimo_sft.config.lora import distributed_optimizer_in_use
from mimo_sft.train.checkpoint.model import encoder_replica_rank, model_sharded_state_dict

OPTIMIZER_DIR = "optimizer"
_COMMON = "_mimo_sft_common"
#: the distributed optimizer's formats (see the module docstring); megatron-core 0.19.2 refuses the
#: flattened ShardedTensors of its default 'fully_sharded_model_space'
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
RESHARDABLE_BOXES = "fully_reshardable_boxes"
#: what a checkpoint without ``distributed_optimizer_format`` in its meta.json holds (written before it existed)
OLDER_FORMAT = FULLY_RESHARDABLE


def save_format(cfg) -> str | None:
    """The distributed optimizer's format this run saves (None: plain optimizer, also with LoRA,
    which keeps the plain one whatever ``--use-distributed-optimizer`` says)."""
    if not distributed_optimizer_in_use(cfg):
        return None
    return RESHARDABLE_BOXES if cfg.checkpoint.save_reshardable else DP_RESHARDABLE


def saved_format(meta: dict) -> str | None:
    if not meta.get("use_distributed_optimizer"):
        return None
    return meta.get("distributed_optimizer_format", OLDER_FORMAT)


def _optimizer_sharded_state_dict(ctx, *, is_loading: bool, sharding: str | None) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedObject
    from megatron.core.models.mimo.optimizer import _get_replica_id


    from mimo_sft.train.checkpoint.reshard import boxes_for_reshardable

    model_sd = model_sharded_state_dict(ctx.model, encoder_replica_rank(ctx))
    # plain optimizers ignore it; the boxes are megatron's fully_reshardable form, written by shards
    metadata = {"distrib_optim_sharding_type": DP_RESHARDABLE if sharding == DP_RESHARDABLE else FULLY_RESHARDABLE,
                # the reshardable form names each tensor by its parameter alone, not by which chained optimizer
                # holds it: megatron splits a mixture-of-experts model's experts into a second optimizer only at
                # ep > 1, so only then is an ep 2 checkpoint's state found by an ep 1 run (a dense model has one
                # optimizer, no prefix either way)
                "chained_optim_avoid_prefix": True}
    # megatron's gathered form is read as boxes too: the same stored tensors, each rank reading its own part
    boxes = distributed_optimizers(ctx.optimizer) if sharding not in (None, DP_RESHARDABLE) else []
    with boxes_for_reshardable(boxes):  # each rank's own shard, not megatron's gather (module docstring)
        sd = ctx.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    for name, module_sd in sd.items():
        if not module_sd:
            continue
        # local objects (the current run's parameter ids in param groups) stay where megatron unwraps them
        sharded, common = extract_matching_values(
            module_sd, lambda v: isinstance(v, (ShardedBase, LocalNonpersistentObject)))
        info = ctx.optimizer.module_infos[name]
        if not is_loading:
            _zero_padding(sharded)
        sharded[_COMMON] = ShardedObject(f"optimizer.mimo.{name}.common", common, (1,), (0,),
                                         replica_id=_get_replica_id(info.pg_collection))
        _count_cp_replicas(sharded, _get_replica_id(info.pg_collection), ctx.pstate.modules[name].pg_collection)
        sd[name] = sharded
    return sd


#: the objects megatron's MIMO optimizer (and ours, the common state) marks with replica id ``(tp, pp, dp)``; their
#: keys are the same on every rank of the module (the distributed optimizer's own objects number their replicas
#: over its DP group, dp x cp, and a mixture-of-experts' expert shards have keys of their own)
_MIMO_OBJECTS = ("param_state_sharding_type", ".param_groups", ".grad_scaler", ".common")


def _count_cp_replicas(node, replica_id: tuple, pgc) -> None:
    """Under context parallelism, the objects megatron's MIMO optimizer marks with replica id ``(tp, pp, dp)``
    (``_get_replica_id``: its parameter groups, sharding type, the common state) are held by every cp rank of a
    DP rank alike: number the replicas over dp x cp instead, so that one rank writes each."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if pgc is None or pgc.cp.size() == 1:
        return
    if isinstance(node, ShardedObject):
        if node.key.endswith(_MIMO_OBJECTS) and tuple(node.replica_id) == tuple(replica_id):
            node.replica_id = (*replica_id[:2], pgc.dp_cp.rank())
    elif isinstance(node, dict):
        for value in node.values():
            _count_cp_replicas(value, replica_id, pgc)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _count_cp_replicas(value, replica_id, pgc)


def _zero_padding(node) -> None:
    """Zero the gaps between parameters that megatron's ``dp_reshardable`` map writes from fresh
    ``torch.empty`` buffers, so a checkpoint's bytes are a function of the state alone."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(node, dict):
        flag = node.get("padding")
        if isinstance(flag, LocalNonpersistentObject) and flag.obj is True:
            for value in node.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
        for value in node.values():
            _zero_padding(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _zero_padding(value)


def optimizer_save_request(folder: str, ctx):
    """Collective: the write of this rank's shards of every module's optimizer state under ``folder``
    (a megatron ``AsyncRequest``: :mod:`write`)."""
    from mimo_sft.train.checkpoint.write import part_request

    sd = _optimizer_sharded_state_dict(ctx, is_loading=False, sharding=save_format(ctx.cfg))
    return part_request(sd, folder)


def has_optimizer(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, OPTIMIZER_DIR, "metadata.json"))


def load_optimizer(folder: str, ctx, *, sharding: str | None) -> None:
    """Collective: load this layout's shards of the optimizer state saved under ``folder`` in format
    ``sharding`` (:func:`saved_format`; any layout for a reshardable one, :func:`check_resumable`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.models.mimo.optimizer import _iter_optimizer_sub_dicts
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mimo_sft.train.checkpoint.trusted import trusted_part

    for opt in distributed_optimizers(ctx.optimizer):
        _allocate_state(opt)
    trusted_part(folder)  # megatron unpickles what it reads: only what passed the restricted readers
    state = dist_checkpointing.load(_optimizer_sharded_state_dict(ctx, is_loading=True, sharding=sharding), folder)
    param_states = []
    for name in list(state):
        module_sd = state[name]
        if not module_sd:
            continue
        if _COMMON in module_sd:
            common = module_sd.pop(_COMMON)
            align_param_groups(module_sd, common)
            module_sd = state[name] = merge(module_sd, common)
        for sub_sd, inner in _iter_optimizer_sub_dicts(module_sd, ctx.optimizer.module_infos[name].optimizer):
            inner = getattr(inner, "chained_optimizers", [inner])[0]  # a chain of one: its optimizer
            _schedule_from_this_run(sub_sd, inner)
            if isinstance(inner, DistributedOptimizer) and "param_state" in sub_sd:
                kind = [v for k, v in sub_sd.items() if k.startswith("_mimo_param_state_sharding_type")]
                # dp_reshardable keeps it inside megatron's own object
                assert kind in ([DP_RESHARDABLE if sharding == DP_RESHARDABLE else FULLY_RESHARDABLE], []), kind
                param_states.append((inner, sub_sd.pop("param_state")))
                sub_sd.pop("param_state_sharding_type", None)
    ctx.optimizer.load_state_dict(state)  # param groups and step; the distributed shards follow
    for opt, param_state in param_states:
        _load_param_state(opt, param_state, sharding)
    from mimo_sft.parallel.megatron_patches import adam_steps_on_policy

    adam_steps_on_policy(ctx.optimizer)  # saved by a fused or a foreach Adam: where this run's kernel wants them


def _group_identity(group: dict) -> tuple:
    return tuple(group.get(k) for k in ("wd_mult", "max_lr", "min_lr", "is_expert_parallel"))


def _aligned_groups(current: list, saved: list) -> list:
    """``saved`` param groups in the order of ``current``, matched by their hyperparameters. megatron
    builds a module's groups from the union of every rank's groups in the same call: where the layout
    pairs the language and vision modules' calls (non-colocated) each optimizer also has the other's
    (empty) groups, where it does not (colocated) it has only its own. A group of this run that the
    checkpoint lacks is such an empty one: it keeps its own values."""
    left = list(saved)
    out = []
    for group in current:
        match = next((g for g in left if _group_identity(g) == _group_identity(group)), None)
        if match is None:
            if group.get("params"):
                from mimo_sft.errors import UserError

                raise UserError("--load-checkpoint: this layout groups the optimizer's parameters differently from "
                                "the checkpoint's and a learning rate changed; resume once with the --lr, --min-lr, "
                                "--vision-lr and --projector-lr it was saved with")
            match = ({k: v for k, v in group.items() if k != "params"} | {"params": []}
                     | ({"step": saved[0]["step"]} if saved and "step" in saved[0] else {}))
        else:
            left.remove(match)
        out.append(match)
    return out


def align_param_groups(template, loaded) -> None:
    """Make every param-group list in ``loaded`` (a checkpoint's common optimizer state) line up with
    the same list in ``template`` (this run's), in place, when their lengths differ."""
    if not (isinstance(template, dict) and isinstance(loaded, dict)):
        return
    for key, value in loaded.items():
        if key not in template:
            continue
        mine = template[key]
        groups = key == "param_groups" or str(key).startswith("_mimo_param_groups")
        if groups and isinstance(value, list) and isinstance(mine, list) and len(value) != len(mine):
            loaded[key] = _aligned_groups(mine, value)
        else:
            align_param_groups(mine, value)


#: param-group keys megatron pairs saved and current groups by that this run's flags own (--lr,
#: --min-lr): a resume with another learning rate keeps its groups
_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def _schedule_from_this_run(sub_sd: dict, inner) -> None:
    """Give the loaded param groups this run's schedule values, paired by position (groups are
    built in the same order on every layout); megatron would not find a group whose --lr changed."""
    key = next((k for k in sub_sd if k.startswith("_mimo_param_groups")), None)
    holder = sub_sd if key is not None else (sub_sd.get("optimizer") or sub_sd)
    key = key or "param_groups"
    if isinstance(holder, dict) and key not in holder and key in sub_sd:
        holder = sub_sd
    saved = holder.get(key) if isinstance(holder, dict) else None
    current = inner.optimizer.param_groups
    if not isinstance(saved, list):
        return
    if len(saved) != len(current):  # another layout's empty groups (see _aligned_groups)
        saved = holder[key] = _aligned_groups(current, saved)
    for group, now in zip(saved, current):
        for key in _SCHEDULE_KEYS:
            if key in now:
                group[key] = now[key]


def _load_param_state(opt, param_state, sharding: str) -> None:
    """The loaded shards into the optimizer (``dp_reshardable`` and ``fully_reshardable``: megatron's own
    loading; the boxes: :mod:`reshard`), with torch Adam's per-parameter ``step`` tensors set aside meanwhile: megatron copies every tensor of a
    parameter's state from the checkpoint, and the step (restored from the param groups) is not
    among them. Each parameter then gets a step tensor of its own: megatron's ``load_state_dict``
    hands torch Adam one tensor for all of them, which each parameter's update would increment
    again. (TE/apex's fused Adam, megatron's usual one on GPUs, keeps no such tensor.)"""
    import torch

    steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
    try:
        if sharding == DP_RESHARDABLE:
            with torch.no_grad():  # an fp32 run's main weights are views of the trained parameters
                opt.load_parameter_state_from_dp_reshardable(param_state)
        elif "_mimo_sft_box_loads" in opt.__dict__:  # both reshardable forms (:mod:`reshard`)
            from mimo_sft.train.checkpoint.reshard import load_param_state_boxes

            load_param_state_boxes(opt, param_state, opt.__dict__.pop("_mimo_sft_box_loads"))
        else:  # megatron's own reading of its gathered form (the tests compare the two)
            opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step.detach().clone()


def distributed_optimizers(optimizer) -> list:
    """megatron DistributedOptimizers inside the MIMO optimizer, in a fixed order."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found = []
    for name in sorted(optimizer.module_infos):
        info = optimizer.module_infos[name]
        opt = info.optimizer if info.is_active else None
        if opt is None:
            continue
        for inner in getattr(opt, "chained_optimizers", [opt]):
            if isinstance(inner, DistributedOptimizer):
                found.append(inner)
    return found


def _allocate_state(opt) -> None:
    """Give a fresh DistributedOptimizer's torch optimizer its (uninitialised) Adam state, as its own
    ``load_state_dict`` allocates it: its ``sharded_state_dict`` reads the step from that state
    (without apex/TE), which a never-stepped optimizer lacks. The load overwrites every value."""
    if len(opt.optimizer.state) != 0:
        return
    groups = [{k: v for k, v in g.items() if k != "params"} | {"step": 0}
              for g in opt.optimizer.state_dict()["param_groups"]]
    opt.load_state_dict({"optimizer": {"param_groups": groups}})
