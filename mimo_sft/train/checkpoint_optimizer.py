"""The optimizer's state as a megatron dist-checkpoint (``iter_N/optimizer/``): layout-free.

Every module's optimizer (plain or distributed, fp32 or bf16) describes its state with
``MimoOptimizer.sharded_state_dict``: Adam moments and fp32 main weights as sharded tensors keyed
by the model parameter they belong to (the distributed optimizer in megatron's
``fully_reshardable`` format: its shards gathered over the module's DP group into parameter-shaped
tensors while saving, sliced again while loading), param groups as one object per module. A run
with another layout (DP, TP, PP, colocated or not) asks for its own shards of the same keys, so
the state is resharded on load. (The gather holds a module's whole TP/PP-local optimizer state on
each of its DP ranks while a distributed-optimizer run saves.)

What megatron leaves as "common" state (the plain optimizers' shared Adam ``step``) would be
written by rank 0 only -- in a non-colocated run rank 0 holds no encoder, so the encoder's step
would be lost. Each module's common part is therefore saved as one more object of its own
(``optimizer.mimo.<module>.common``), written by the module's rank (tp 0, pp 0, dp 0).

The model sharded state dict the optimizer's map is built from must hold the very parameter
objects the optimizer steps: the wrapper-free one of ``checkpoint.model_sharded_state_dict``.
"""

from __future__ import annotations

import os

from mimo_sft.train.checkpoint_model import encoder_replica_rank, model_sharded_state_dict

OPTIMIZER_DIR = "optimizer"
_COMMON = "_mimo_sft_common"
#: the distributed optimizer's format: whole parameter-shaped tensors (gathered over the module's
#: DP group while saving; each rank slices its range while loading). megatron-core 0.19.2 refuses
#: the flattened ShardedTensors of its default 'fully_sharded_model_space'.
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _optimizer_sharded_state_dict(ctx, *, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedObject
    from megatron.core.models.mimo.optimizer import _get_replica_id


    model_sd = model_sharded_state_dict(ctx.model, encoder_replica_rank(ctx))
    sd = ctx.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(_METADATA))
    for name, module_sd in sd.items():
        if not module_sd:
            continue
        # local objects (the current run's parameter ids in param groups) stay where megatron unwraps them
        sharded, common = extract_matching_values(
            module_sd, lambda v: isinstance(v, (ShardedBase, LocalNonpersistentObject)))
        info = ctx.optimizer.module_infos[name]
        sharded[_COMMON] = ShardedObject(f"optimizer.mimo.{name}.common", common, (1,), (0,),
                                         replica_id=_get_replica_id(info.pg_collection))
        sd[name] = sharded
    return sd


def save_optimizer(folder: str, ctx) -> None:
    """Collective: write this rank's shards of every module's optimizer state under ``folder``."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_optimizer_sharded_state_dict(ctx, is_loading=False), folder)


def has_optimizer(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, OPTIMIZER_DIR, "metadata.json"))


def load_optimizer(folder: str, ctx) -> None:
    """Collective: load this layout's shards of the optimizer state saved under ``folder`` (any layout)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.models.mimo.optimizer import _iter_optimizer_sub_dicts
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in distributed_optimizers(ctx.optimizer):
        _allocate_state(opt)
    state = dist_checkpointing.load(_optimizer_sharded_state_dict(ctx, is_loading=True), folder)
    param_states = []
    for name in list(state):
        module_sd = state[name]
        if not module_sd:
            continue
        if _COMMON in module_sd:
            module_sd = state[name] = merge(module_sd, module_sd.pop(_COMMON))
        for sub_sd, inner in _iter_optimizer_sub_dicts(module_sd, ctx.optimizer.module_infos[name].optimizer):
            inner = getattr(inner, "chained_optimizers", [inner])[0]  # a chain of one: its optimizer
            _schedule_from_this_run(sub_sd, inner)
            if isinstance(inner, DistributedOptimizer) and "param_state" in sub_sd:
                kind = [v for k, v in sub_sd.items() if k.startswith("_mimo_param_state_sharding_type")]
                assert kind == [_METADATA["distrib_optim_sharding_type"]], kind
                param_states.append((inner, sub_sd.pop("param_state")))
    ctx.optimizer.load_state_dict(state)  # param groups and step; the distributed shards follow
    for opt, param_state in param_states:
        _load_fully_reshardable(opt, param_state)


#: param-group keys megatron pairs saved and current groups by that this run's flags own (--lr,
#: --min-lr): a resume with another learning rate keeps its groups
_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def _schedule_from_this_run(sub_sd: dict, inner) -> None:
    """Give the loaded param groups this run's schedule values, paired by position (groups are
    built in the same order on every layout); megatron would not find a group whose --lr changed."""
    saved = next((v for k, v in sub_sd.items() if k.startswith("_mimo_param_groups")), None)
    if saved is None:
        saved = (sub_sd.get("optimizer") or {}).get("param_groups", sub_sd.get("param_groups"))
    current = inner.optimizer.param_groups
    if not isinstance(saved, list) or len(saved) != len(current):
        return
    for group, now in zip(saved, current):
        for key in _SCHEDULE_KEYS:
            if key in now:
                group[key] = now[key]


def _load_fully_reshardable(opt, param_state) -> None:
    """megatron's own slicing of the whole tensors into this rank's shard, with torch Adam's
    per-parameter ``step`` tensors set aside meanwhile: megatron copies every tensor of a
    parameter's state from the checkpoint, and the step (restored from the param groups) is not
    among them. Each parameter then gets a step tensor of its own: megatron's ``load_state_dict``
    hands torch Adam one tensor for all of them, which each parameter's update would increment
    again. (TE/apex's fused Adam, megatron's usual one on GPUs, keeps no such tensor.)"""
    steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
    try:
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
