"""Build what one rank trains, in the order megatron requires; loads nothing.

``build_state``: the layout's process groups (``parallel.groups``; the world group was started by
``parallel.bootstrap``) -> ``build_model_and_optimizer``: megatron's process-local state with this
rank's tensor/expert ranks (``parallel.runtime.init_megatron``, the same call on CPU and GPU) ->
MimoModel for this rank's modules on this rank's device (colocated fan-in / fan-out: its bridge
communicators wrapped by ``train.bridge.PaddedBridge``) -> megatron DDP per module -> megatron's
MIMO optimizer, returned together as a ``TrainContext``. The model holds the weights of
``--hf-model`` (or random ones); a checkpoint or ``--pretrained-checkpoint`` is loaded afterwards
by ``train.checkpoint.restore`` (the trainer's ``resume``). This file only wires.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.config.checks.overlap import overlap_param_gather_in_use
from mimo_sft.config.lora import LoraSpec, distributed_optimizer_in_use
from mimo_sft.parallel import runtime  # first: importing mimo_sft.parallel makes megatron importable
from mimo_sft.parallel.groups import ParallelState, build_parallel_state, megatron_ranks  # noqa: F401 (re-export)
from mimo_sft.parallel.layout import LANGUAGE, Layout
from mimo_sft.model.lora import apply_lora
from mimo_sft.train.bridge import install_padded_bridges
from mimo_sft.errors import UserError
from mimo_sft.parallel.megatron_patches import (FiniteGradMimoOptimizer, OrderedGradReduce, install_optimizer_kernels,
                                                use_fused_adam)
from mimo_sft.train.buckets import check_bucket_shards, language_bucket_size, requested_bucket_size

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.optimizer.optimizer_config import OptimizerConfig  # noqa: E402


@dataclass
class TrainContext:
    """One rank's built model and optimizer (what ``train.checkpoint`` saves and restores)."""

    cfg: ExperimentConfig
    layout: Layout
    pstate: ParallelState
    model: Any
    info: Any
    modules: dict
    optimizer: Any
    rank: int
    #: parameters per gradient bucket of the language model (``train.buckets``; None: one bucket)
    language_bucket_size: Optional[int] = None
    #: the same for the vision modules (:func:`vision_bucket_size`; None: one bucket, no overlap)
    vision_bucket_size: Optional[int] = None

    def finish_param_gather(self) -> None:
        """Every DP replica holds the updated weights on return. With ``--overlap-param-gather`` the
        optimizer step leaves the all-gather of the other ranks' shards to the next forward's
        pre-hooks; whoever reads the weights before it (a checkpoint save) calls this first.
        Collective over each overlapping module's DP group; megatron's next forward then finds the
        gather done and issues none."""
        for module in self.modules.values():
            if module.ddp_config.overlap_param_gather:
                module.start_param_sync(force_sync=True)

    @property
    def is_metrics_rank(self) -> bool:
        """The rank that owns the language loss: language tp 0, dp 0, last pipeline stage."""
        c = self.layout.coords(self.rank).get(LANGUAGE)
        return c is not None and c.tp == 0 and c.dp == 0 and c.cp == 0 and c.pp == self.layout.language.pp - 1


def build_model_and_optimizer(cfg: ExperimentConfig, layout: Layout, pstate: ParallelState, rank: int, *,
                              with_optimizer: bool = True, startup=None) -> TrainContext:
    """``with_optimizer=False`` (``mimo-sft evaluate``): the DDP-wrapped model only, no optimizer state.
    ``startup``: the trainer's ``train.startup.StartupClock``, which times the optimizer's part."""
    from mimo_sft.data.processor import resolve_image_backend
    from mimo_sft.model import build_mimo_model
    from mimo_sft.model.builder import set_pixel_norm
    from mimo_sft.model.pixels import pixel_norm_from

    runtime.init_megatron(cfg.train.seed, **megatron_ranks(pstate))
    model, info = build_mimo_model(
        cfg.model.hf_model, layout=layout, parallel_state=pstate, model_cfg=cfg.model,
        random_init=cfg.model.allow_random_init,
        config_overrides={"calculate_per_token_loss": True, "attention_dropout": 0.0, "hidden_dropout": 0.0},
        max_seq_len=cfg.data.seq_length)
    set_pixel_norm(model, pixel_norm_from(cfg.model.hf_model, resolve_image_backend(cfg.data.image_backend)))
    from mimo_sft.train.tower_split import install as split_tower, mark_partial_grads

    split_tower(model, pstate, info)  # images tp > 1: the replicas share each micro-batch's images and clip frames
    if cfg.reorder.encoder_balance:  # images to the least-loaded tower, embeddings back (train.encoder_balance)
        from mimo_sft.train.encoder_balance import install

        install(model, pstate, info)
        info.always_encode = True
    lora = LoraSpec.from_model_config(cfg.model)
    if lora is not None:  # adapters on top of the loaded weights, before DDP sees the parameters (model.lora)
        lang = pstate.modules[LANGUAGE]
        apply_lora(model, lora, seed=cfg.train.seed, dp_rank=lang.pg_collection.dp.rank() if lang.member else 0)
    mark_partial_grads(model, pstate)  # the tower replicas' gradients are summed over images tp (train.tower_split)
    mark_vision_lr_params(model, family_adapter(info.model_type).projector_param)
    model.to(runtime.device())
    model.model_type = ModelType.encoder_or_decoder  # forward_backward_no_pipelining looks it up
    if layout.colocated:  # fan-in / fan-out bridges cut encoder output on sample boundaries
        install_padded_bridges(model, layout, micro_batch_size=cfg.train.micro_batch_size,
                               image_token_id=info.image_token_id)
    modules, bucket_size, vision_size = _wrap_in_ddp(cfg, model, info, pstate, rank)
    if not with_optimizer:
        return TrainContext(cfg, layout, pstate, model, info, modules, None, rank, bucket_size, vision_size)
    with startup.part("optimizer") if startup is not None else nullcontext():
        optimizer = _build_optimizer(cfg, model, modules)
    return TrainContext(cfg, layout, pstate, model, info, modules, optimizer, rank, bucket_size, vision_size)


def _build_optimizer(cfg: ExperimentConfig, model, modules: dict):
    """megatron's MIMO optimizer over ``modules`` (none for a module with nothing to train), with mimo-sft's
    kernels (``parallel.megatron_patches``)."""
    bf16 = cfg.model.dtype == "bf16"
    o = cfg.optimizer
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16, fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distributed_optimizer_in_use(cfg),
        overlap_param_gather=overlap_param_gather_in_use(cfg))  # megatron: "the same value as" DDP's
    install_optimizer_kernels()  # a few kernels per bucket where megatron would loop over tensors
    optimizer = _without_empty_optimizers(build_mimo_optimizer(model, opt_cfg, _lr_overrides(o)), modules)
    use_fused_adam(optimizer)
    return optimizer


def _wrap_in_ddp(cfg: ExperimentConfig, model, info, pstate: ParallelState, rank: int):
    """megatron DDP around each module this rank runs: ``(modules, language bucket size, vision bucket
    size)``. A vision module that overlaps starts its buckets' reductions in bucket order
    (``parallel.megatron_patches.OrderedGradReduce``: its ranks may skip it)."""
    modules = {}
    bucket_size = language_bucket_size(cfg, announce=rank == 0)  # every rank: rank 0 writes it to meta.json
    vision_size = vision_bucket_size(cfg)
    if model.language_model is not None:
        model.language_model = DistributedDataParallel(
            config=info.language_config, ddp_config=ddp_config_for(cfg, language=True, bucket_size=bucket_size),
            module=model.language_model, pg_collection=pstate.modules[LANGUAGE].pg_collection)
        check_bucket_shards(model.language_model, bucket_size)
        modules[LANGUAGE] = model.language_model
    for name in list(model.modality_submodules.keys()):
        sub = model.modality_submodules[name]
        if sub is None:
            continue
        wrapped = DistributedDataParallel(config=info.vision_config,
                                          ddp_config=ddp_config_for(cfg, language=False, bucket_size=vision_size),
                                          module=sub, pg_collection=pstate.modules[name].pg_collection)
        _check_vision_shards(wrapped, name, vision_size)
        OrderedGradReduce.install(wrapped)
        model.modality_submodules[name] = wrapped
        modules[name] = wrapped
    return modules, bucket_size, vision_size


#: the checkpoint meta.json key of the vision modules' bucket size (absent: one bucket, as every
#: checkpoint saved before the vision modules overlapped holds)
VISION_META_KEY = "vision_ddp_bucket_size"


def vision_bucket_size(cfg: ExperimentConfig) -> Optional[int]:
    """Parameters per gradient bucket of the vision modules (None: one bucket, reduced after backward):
    ``--ddp-bucket-size`` as for the language model (``train.buckets``), except on a resume of a
    DP-reshardable distributed-optimizer checkpoint, whose buffers load only into the buckets they were
    saved in: its ``vision_ddp_bucket_size``."""
    from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint
    from mimo_sft.train.checkpoint.optimizer import DP_RESHARDABLE, saved_format

    wanted = requested_bucket_size(cfg)
    path = cfg.checkpoint.load_checkpoint
    if not path or not distributed_optimizer_in_use(cfg):
        return wanted
    try:
        meta = read_meta(resolve_checkpoint(path))
    except UserError:
        return wanted  # train.checkpoint.restore says what is wrong with the folder
    return meta.get(VISION_META_KEY) if saved_format(meta) == DP_RESHARDABLE else wanted


def _check_vision_shards(ddp_module, name: str, bucket_size: Optional[int]) -> None:
    """``train.buckets.check_bucket_shards`` for a vision module (its message names the module)."""
    try:
        check_bucket_shards(ddp_module, bucket_size)
    except UserError as err:
        raise UserError(str(err).replace("the language model's", f"the {name} module's")) from None


def ddp_config_for(cfg: ExperimentConfig, *, language: bool, bucket_size: Optional[int] = None) -> DistributedDataParallelConfig:
    """megatron DDP's settings for one module (a fresh object each: megatron's DDP writes its resolved
    bucket size into the config it is given); fp32 gradient buffers.

    The language model overlaps: ``--overlap-grad-reduce`` starts each bucket's reduce-scatter /
    all-reduce from the backward hook of its last parameter in the step's last micro-batch (megatron's
    schedules bracket the others in ``train.step``'s ``no_sync``), and ``--overlap-param-gather``
    (distributed optimizer) all-gathers the updated weights bucket by bucket from forward pre-hooks of
    the next forward instead of right after the optimizer step (``TrainContext.finish_param_gather``
    completes them where weights are read otherwise: a checkpoint save). Both are exact there because
    every language rank computes every parameter in every micro-batch, so all DP ranks issue the same
    collectives in the same order. ``bucket_size``: parameters per bucket (``train.buckets``; None:
    one bucket).

    The vision modules overlap their reduction too (with ``bucket_size`` their own, ``vision_bucket_size``;
    None: one bucket, reduced after backward), but a vision rank whose micro-batch has no image skips
    the encoder, so its buckets would never become ready: ``parallel.megatron_patches.OrderedGradReduce``
    starts every rank's buckets in bucket order, in backward as they complete and the rest just before
    the finalize (``train.step``), so DP peers pair the same collectives. They gather their weights
    right after the optimizer step (no ``overlap_param_gather``): their forward pre-hooks would fire
    only on ranks with images.

    No ``check_for_nan_in_grad``: megatron's check costs two host syncs per bucket inside the overlapped
    backward; ``parallel.megatron_patches.FiniteGradMimoOptimizer`` checks the step's reduced gradients
    once, in the grad norm."""
    o = cfg.optimizer
    overlap = bool(o.overlap_grad_reduce) and (language or bucket_size is not None)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        overlap_param_gather=overlap_param_gather_in_use(cfg) and language,
        use_distributed_optimizer=distributed_optimizer_in_use(cfg),
        check_for_nan_in_grad=False, bucket_size=bucket_size if overlap else None)


#: parameter attributes that route a vision-module parameter to its learning rate (set below, read by
#: megatron's ``ParamKey(attr=...)`` when the param groups are built)
VISION_LR_ATTR, PROJECTOR_LR_ATTR = "_mimo_sft_vision_lr", "_mimo_sft_projector_lr"


def family_adapter(model_type: str):
    from mimo_sft.config import families
    from mimo_sft.model.registry import adapter_for

    return adapter_for(families.family_for_model_type(model_type))


def _lr_overrides(o) -> dict:
    """megatron param-group overrides: its standard ones (no weight decay for norms and biases: ``wd_mult``
    0), and the vision tower's and the merger's own peak and floor (``--vision-lr``, ``--projector-lr``;
    ``--min-lr`` scaled by the same ratio, so the schedule keeps its shape), only where they differ from
    ``--lr``: a run without them has megatron's own groups. (megatron builds a module's groups from the
    union over the ranks building at the same time, which depends on the layout when modules' groups
    differ; ``train.checkpoint.optimizer.align_param_groups`` pairs them on another layout's resume.)"""
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey

    overrides = get_standard_config_overrides(_opt_config_for_overrides(o))
    for attr, peak in ((VISION_LR_ATTR, o.vision_lr), (PROJECTOR_LR_ATTR, o.projector_lr)):
        if peak is None or peak == o.lr:
            continue
        overrides[ParamKey(attr=attr)] = {"max_lr": peak, "min_lr": o.min_lr * (peak / o.lr if o.lr else 1.0)}
    return overrides


def _opt_config_for_overrides(o):
    return OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay)


def mark_vision_lr_params(model, projector_param) -> None:
    """Tag each vision-module parameter as tower or merger (``projector_param`` is the family's rule on
    the HF name; a LoRA adapter follows the layer it adapts)."""
    for sub in model.modality_submodules.values():
        if sub is None:
            continue
        for enc in sub.encoders.values():
            for name, p in enc.named_parameters():
                setattr(p, PROJECTOR_LR_ATTR if projector_param(name) else VISION_LR_ATTR, True)


def build_mimo_optimizer(model, config: OptimizerConfig, overrides: dict):
    """megatron's ``get_mimo_optimizer`` with param-group overrides (megatron's own builds every module's
    optimizer with the standard ones only): one megatron optimizer per module this rank runs, over the
    module grid's groups, joined in a ``MimoOptimizer``."""
    from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
    from megatron.core.models.mimo.optimizer import ModuleOptimizerInfo, _get_pg_collection_for_optimizer
    from megatron.core.optimizer import get_megatron_optimizer

    infos = {}
    for name, grid in model.mimo_config.module_to_grid_map.items():
        active = grid.is_current_rank_in_grid()
        optimizer = pg_collection = None
        module = None
        if active:
            module = model.language_model if name == MIMO_LANGUAGE_MODULE_KEY else model.modality_submodules[name]
        if module is not None:
            pg_collection = _get_pg_collection_for_optimizer(grid)
            optimizer = get_megatron_optimizer(config=config, model_chunks=[module], pg_collection=pg_collection,
                                               use_gloo_process_groups=False, config_overrides=dict(overrides))
        if optimizer is not None:
            optimizer = _without_empty_expert_optimizer(optimizer, module)
        infos[name] = ModuleOptimizerInfo(optimizer=optimizer, grid=grid, pg_collection=pg_collection,
                                          is_active=active)
    return FiniteGradMimoOptimizer(infos, config)


def _without_empty_expert_optimizer(optimizer, module):
    """``optimizer`` without its expert-parallel part where ``module`` has no expert parameter.

    megatron-core 0.19.2's ``_get_param_groups`` aligns the param-group keys over the whole world (an
    ``all_gather_object`` on the default group), so next to a mixture-of-experts language model every
    module -- the vision tower too -- gets an expert-parallel group with no parameter, and with it a
    second, empty distributed optimizer that has no step to report: the first checkpoint asserts
    (``DistributedOptimizer.state_dict``: ``len(steps) == 1``). Decided by the module's parameters, so
    every rank of the module decides alike."""
    from megatron.core.optimizer import ChainedOptimizer

    if any(not getattr(p, "allreduce", True) for p in module.parameters()):
        return optimizer
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    dense = [o for o in parts if not all(g.get("is_expert_parallel", False) for g in o.param_groups)]
    if len(dense) == len(parts):
        return optimizer
    assert all(not g["params"] for o in parts if o not in dense for g in o.param_groups), "expert groups with parameters"
    return ChainedOptimizer(dense)


def _without_empty_optimizers(optimizer, modules: dict):
    """The MIMO optimizer with no optimizer for a module that has nothing to train (a fully frozen vision
    tower: LoRA on the language model only, or --freeze-vision --freeze-projector; a --freeze-language
    model): megatron builds one there anyway (without a torch optimizer, or a distributed one with no
    state, which can never report its step), and its checkpointing cannot describe it. Such a module then
    counts 0 in the grad norm and has no optimizer state, as an inactive one. Decided by the module's
    parameters, so every DP rank of the module decides alike."""
    infos = optimizer.module_infos
    empty = [name for name, info in infos.items() if info.optimizer is not None and name in modules
             and not any(p.requires_grad for p in modules[name].parameters())]
    if not empty:
        return optimizer
    for name in empty:
        infos[name].optimizer = None
    return type(optimizer)(infos, optimizer.config)


def build_state(cfg: ExperimentConfig, layout: Layout) -> ParallelState:
    """The layout's grids and process groups (collective), with the reorder thread's own gloo DP
    group where the exchange overlaps the step or index mode gathers its shard costs (colocated
    layouts reorder by index only: check 11)."""
    r = cfg.reorder
    reorder_side = r.enabled and (r.overlap or r.mode == "index")
    return build_parallel_state(layout, reorder_side_group=reorder_side)
