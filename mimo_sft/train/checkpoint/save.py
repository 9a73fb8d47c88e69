"""Checkpoints of a run's state: a run killed mid-save never loses the previous one, and a run
resumes on any layout.

Layout of ``SAVE_DIR`` (folder rules, fsync order and pruning: :mod:`files`)::

    latest                 -> text file naming the newest complete checkpoint ("iter_0000020")
    iter_0000020/
        meta.json          step, consumed samples, layout, source model, optimizer form, the settings the
                           data order depends on (``data_order``: check 35 compares a resume's flags)
        model/             megatron dist-checkpoint of MimoModel.sharded_state_dict (layout-free;
                           a LoRA run's holds only what trains: :mod:`lora`)
        optimizer/         megatron dist-checkpoint of MimoOptimizer.sharded_state_dict (layout-free):
                           Adam moments and step, param groups, the fp32 main weights of a bf16 run
                           (:mod:`optimizer`)
        rank_00000.pt      this rank's RNG streams (Python, numpy, torch, device, megatron's tracker): tensors,
                           numbers and lists only, read weights-only (:mod:`trusted`, as every pickle a load reads)
    iter_0000020.v2/       a re-save of step 20 (a resumed run reached it again); replaces iter_0000020
    iter_0000030.tmp/      a save in progress: never read, removed by the next save of that step

Every rank writes (and fsyncs) its own shards into ``iter_N.tmp``, in parallel (megatron's fully
parallel save; ``--async-save``: from host copies, on a writer thread while training goes on, :mod:`write`);
once every rank's writes are done rank 0 writes ``meta.json`` and publishes the folder: fsync,
rename, ``latest`` replaced atomically, and only then older copies removed
(:func:`files.publish`). A partial ``.tmp`` folder is never
picked up, and ``latest`` always names a complete checkpoint.

A resume reads each byte once per DP group: the weights are split between a module's DP ranks and
broadcast (:mod:`spread`), and each rank reads only its own shard of the optimizer state.

Weights and optimizer state are megatron dist-checkpoints, so ``--load-checkpoint`` continues on
another layout (language/encoder DP, TP, PP, colocated or not; a distributed optimizer's default
DP-only form only on its saved TP/PP, :mod:`optimizer`) with the same weights, Adam state,
step, LR schedule (a function of the step) and data position (``consumed_samples``: every layout
reads the same global batches). Only the RNG streams are per rank: restored when the layout is
the one the checkpoint was saved with (then a resume is bit-exact), restarted from the seed on
another layout (said in one line).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from mimo_sft.config.lora import distributed_optimizer_in_use
from mimo_sft.config.checks.checkpoint import data_order_meta, reshard_problem, resolved_path
from mimo_sft.config.recorded import schedule_meta
from mimo_sft.errors import UserError
from mimo_sft.parallel import runtime
from mimo_sft.train.checkpoint.files import fsync_file, iter_dir, kill_point, publish, read_meta, resolve_checkpoint
from mimo_sft.train.checkpoint.optimizer import (OPTIMIZER_DIR, has_optimizer, load_optimizer, optimizer_save_request,
                                                 save_format, saved_format)
from mimo_sft.train.checkpoint.write import PendingSaves, one_request, part_request, run_now
from mimo_sft.train.checkpoint.lora import check_lora_compatible, has_lora, is_stored, lora_load_entries, lora_meta
from mimo_sft.train.checkpoint.model import (encoder_replica_rank, layout_signature, mark_encoder_replicas,
                                             model_sharded_state_dict, unwrapped)
from mimo_sft.train.checkpoint.trusted import load_rank_file, stored_tensor_keys, trusted_part, verify_checkpoint


def save_checkpoint(root: str, *, step: int, consumed_samples: int, ctx, extra_meta: dict | None = None,
                    keep_last: int | None = None, pending: PendingSaves | None = None, on_published=None) -> str | None:
    """Collective: every rank calls it. Returns the published folder (see the module docstring), or
    None when ``pending`` is given: the save then completes in the background and
    ``on_published(folder)`` runs (every rank) once it is published (:mod:`write`).

    ``keep_last`` defaults to the run's ``--keep-last-checkpoints``.
    """
    if keep_last is None:
        keep_last = ctx.cfg.checkpoint.keep_last_checkpoints
    if pending is not None:
        pending.wait()  # one save in flight at a time
    ctx.finish_param_gather()  # --overlap-param-gather: the updated weights, not the previous step's shards
    rank = dist.get_rank()
    tmp = iter_dir(root, step) + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(tmp):  # left by a save that was killed
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, "model"))
        os.makedirs(os.path.join(tmp, OPTIMIZER_DIR))
    dist.barrier()
    kill_point("start", step)
    rank_file = os.path.join(tmp, f"rank_{rank:05d}.pt")
    torch.save({"rng": runtime.rng_state(), "step": step, "consumed_samples": consumed_samples,
                "layout": layout_signature(ctx.layout), "device": runtime.device().type}, rank_file)
    fsync_file(rank_file)
    parts = [part_request(model_sharded_state_dict(ctx.model, encoder_replica_rank(ctx)), os.path.join(tmp, "model")),
             optimizer_save_request(os.path.join(tmp, OPTIMIZER_DIR), ctx)]
    meta = {"step": step, "consumed_samples": consumed_samples, "world_size": dist.get_world_size(),
            "layout": layout_signature(ctx.layout),
            # resolved, so that an export or evaluate started in another folder finds the base model
            "hf_model": ctx.cfg.model.hf_model and resolved_path(ctx.cfg.model.hf_model), **_optimizer_kind(ctx),
            **({"distributed_optimizer_format": save_format(ctx.cfg)} if save_format(ctx.cfg) else {}),
            **bucket_meta(ctx), **lora_meta(ctx.cfg.model), **data_order_meta(ctx.cfg), **schedule_meta(ctx.cfg),
            **(extra_meta or {})}
    box = [None]

    def publish_when_written():  # every rank, once every rank's parts are on disk
        if rank == 0:
            kill_point("before_meta", step)
            with open(os.path.join(tmp, "meta.json"), "w") as fh:
                json.dump(meta, fh, indent=1)
            box[0] = publish(root, tmp, step, keep_last=keep_last)
        dist.broadcast_object_list(box, src=0, group=ctx.pstate.world_gloo)
        if on_published is not None:
            on_published(box[0])

    request = one_request(parts, publish_when_written, step=step, background=pending is not None)
    if pending is None:
        run_now(request, tmp=tmp, root=root, step=step)
        return box[0]
    pending.start(request, tmp=tmp, root=root, step=step)
    return None


def save_gradients(folder: str, ctx) -> None:
    """``--save-grads``: this step's reduced gradients (after the DP reduction and the global token
    scale, before clipping and the optimizer) written as a model checkpoint (``folder/model``), so any layout's
    gradients can be compared tensor by tensor with any other's (a 1-rank run's, say). Collective.

    With the distributed optimizer the reduce-scattered grad buffers are all-gathered over DP first.
    Each parameter's value is swapped for its ``main_grad`` (zeros where it has none: frozen) while
    megatron's dist-checkpointing writes, then restored. Holds one extra copy of the weights, in
    the parameters' dtype: a debugging aid for short runs.
    """
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.makedirs(os.path.join(folder, "model"))
    dist.barrier()
    _gather_sharded_grads(ctx)
    params = list(ctx.model.parameters())
    kept = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                grad = getattr(p, "main_grad", None)
                p.copy_(grad if grad is not None else torch.zeros_like(p))
        dist_checkpointing.save(model_sharded_state_dict(ctx.model, encoder_replica_rank(ctx)),
                                os.path.join(folder, "model"))
    finally:
        with torch.no_grad():
            for p, value in zip(params, kept):
                p.copy_(value)
    dist.barrier()


def _gather_sharded_grads(ctx) -> None:
    """With the distributed optimizer each DP rank's grad buffer holds the reduced gradient only in its own
    shard (megatron reduce-scatters); all-gather the shards so every ``main_grad`` is the reduced one.
    The optimizer reads only its own shard, so the step is unchanged."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for module in ctx.modules.values():
        if not module.ddp_config.use_distributed_optimizer:
            continue
        for group in [*module.bucket_groups, *module.expert_parallel_bucket_groups]:
            size = group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            pg = group.intra_distributed_optimizer_instance_group
            for bucket in group.buckets:
                local = shard_buffer(bucket.grad_data, size)[group.intra_distributed_optimizer_instance_rank].clone()
                dist.all_gather_into_tensor(bucket.grad_data, local, group=pg)


def load_model_weights(model, ckpt: str, *, pretrained: bool = False, replicated_encoder_rank: int = 0,
                       spread_groups: dict | None = None) -> None:
    """Load weights from a checkpoint's dist-checkpoint into ``model`` (any layout).

    A model with LoRA adapters loads every tensor the checkpoint holds (a LoRA checkpoint: its
    adapters and unfrozen weights on top of the base weights the model was built with; a full one:
    base weights) and requires what ``lora.lora_load_entries`` says (``pretrained``:
    ``--pretrained-checkpoint``). ``replicated_encoder_rank``: ``model.encoder_replica_rank`` of a
    training rank (a tower replicated over its tp ranks loads as replicas, as it saves).
    ``spread_groups`` (module name -> its DP group; collective over them): each DP rank reads a part of
    the module's tensors and broadcasts it to the others (:mod:`spread`).
    """
    from megatron.core import dist_checkpointing

    from mimo_sft.train.checkpoint.spread import any_failed, plan_spread, share

    folder = os.path.join(ckpt, "model")
    with unwrapped(model) as bare:
        sd = bare.sharded_state_dict()
        mark_encoder_replicas(sd, replicated_encoder_rank)
        required = None
        if has_lora(bare):
            sd, required = lora_load_entries(sd, folder, pretrained=pretrained)
        sd, shares = plan_spread(sd, spread_groups or {})
        try:
            trusted_part(folder)  # megatron unpickles what it reads: only what passed the restricted readers
            state = dist_checkpointing.load(sd, folder)
            missing, _unexpected = bare.load_state_dict(state, strict=False)
        except Exception:
            any_failed(shares, True)
            raise
    if any_failed(shares, False):
        raise UserError(f"checkpoint {ckpt}: another rank could not read its part of the weights (its error says why)")
    received = share(shares)
    bad = ([k for k in missing if not k.endswith("_extra_state") and k not in received] if required is None
           else [k for k in required if k not in state and k not in received])
    if bad:
        raise UserError(f"checkpoint {ckpt}: weights for {bad[:3]} are missing; was it saved from another model?")


def dp_groups(ctx) -> dict:
    """Each module's DP group on this rank (where this rank holds the module)."""
    return {name: m.pg_collection.dp for name, m in ctx.pstate.modules.items()
            if m.member and m.pg_collection is not None}


def model_weight_reader(ckpt: str):
    """``read(model, keys) -> {key: tensor}``: the checkpoint's weights for those ``state_dict`` keys
    of ``model`` (any layout; a meta-device model will do: its ``sharded_state_dict`` names the
    tensors, host buffers of their shapes are made for just these keys), reading only the stored
    chunks of those tensors (``read``). The streamed export
    (``model.export.export_weights``) reads one decoder layer at a time with it.
    """
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from mimo_sft.train.checkpoint.read import read_model_part

    folder = os.path.join(ckpt, "model")
    cache: dict = {}

    def read(model, keys) -> dict:
        if cache.get("model") is not model:
            with unwrapped(model) as bare:
                cache.update(model=model, sharded=bare.sharded_state_dict())
        sharded = cache["sharded"]
        missing = [k for k in keys if not isinstance(sharded.get(k), (ShardedTensor, ShardedTensorFactory))]
        assert not missing, f"checkpoint keys for {missing[:3]} not in the model's sharded state dict"
        part = {k: replace(sharded[k], data=torch.empty(sharded[k].data.shape, dtype=sharded[k].data.dtype, device="cpu"))
                for k in keys}
        return read_model_part(part, folder)

    return read


def stored_state_keys(ckpt: str):
    """``stored(model) -> set``: the ``state_dict`` keys of ``model`` whose tensors the checkpoint's
    ``model/`` holds (a LoRA checkpoint holds only what trained), from its metadata alone."""
    folder = os.path.join(ckpt, "model")

    def stored(model) -> set:
        present = stored_tensor_keys(folder)
        with unwrapped(model) as bare:
            sharded = bare.sharded_state_dict()
        return {k for k, v in sharded.items() if is_stored(v, present)}

    return stored


def restore(cfg, ctx) -> tuple[int, int]:
    """Load what the run starts from into the built model and optimizer; returns (step, consumed).

    ``--load-checkpoint``: everything (see :func:`load_checkpoint`). ``--pretrained-checkpoint``: the
    weights, then the optimizer's fp32 main weights refreshed from them -- megatron copies those when
    the optimizer is built, so without the refresh a bf16 run's first step would overwrite the
    loaded weights with the initial ones plus one update.
    """
    if cfg.checkpoint.load_checkpoint:
        return load_checkpoint(cfg.checkpoint.load_checkpoint, ctx)
    if cfg.model.pretrained_checkpoint:
        ckpt = resolve_checkpoint(cfg.model.pretrained_checkpoint)
        check_lora_compatible(read_meta(ckpt), cfg.model, path=ckpt, resume=False)
        trusted_part(os.path.join(ckpt, "model"))  # refused in one line before anything is read
        load_model_weights(ctx.model, ckpt, pretrained=True, replicated_encoder_rank=encoder_replica_rank(ctx),
                           spread_groups=dp_groups(ctx))
        ctx.optimizer.reload_model_params()
    return 0, 0


def load_checkpoint(path: str, ctx) -> tuple[int, int]:
    """Resume on any layout: model, optimizer (with fp32 main weights), data position, and the RNG
    streams where the layout is the saved one.

    Order matters: weights into the model, main weights refreshed from them (covers parameters a
    checkpoint has no main copy of), then the optimizer state, which for a bf16 run overwrites the
    main weights with the saved fp32 values. Returns (step, consumed_samples).
    """
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    saved_layout = meta.get("layout")
    same_layout = saved_layout == layout_signature(ctx.layout)
    if not has_optimizer(ckpt):
        if same_layout:
            hint = "it was written by an older mimo-sft; start from its weights with --pretrained-checkpoint"
        else:
            hint = (f"it was written by an older mimo-sft, which can only resume with the layout it was saved "
                    f"with ({_fmt_layout(saved_layout or [])}), or start from its weights with --pretrained-checkpoint")
        raise UserError(f"--load-checkpoint {ckpt}: no sharded optimizer state ({OPTIMIZER_DIR}/); {hint}")
    check_lora_compatible(meta, ctx.cfg.model, path=ckpt, resume=True)
    for key, value in _optimizer_kind(ctx).items():
        if key in meta and meta[key] != value:
            flag = {"use_distributed_optimizer": "--use-distributed-optimizer / --no-use-distributed-optimizer",
                    "dtype": "--dtype"}.get(key, key)
            raise UserError(f"--load-checkpoint {ckpt} was saved with {key}={meta[key]} but this run uses {value}; "
                            f"resume with the setting it was saved with ({flag}), or start from its weights with "
                            f"--pretrained-checkpoint")
    problem = reshard_problem(meta, layout_signature(ctx.layout))
    if problem:
        raise UserError(f"--load-checkpoint {ckpt}: {problem}")
    rank_file = os.path.join(ckpt, f"rank_{dist.get_rank():05d}.pt")
    if same_layout and not os.path.isfile(rank_file):
        raise UserError(f"--load-checkpoint {ckpt}: {os.path.basename(rank_file)} is missing; the checkpoint is incomplete")
    # every pickle this rank will read, through the restricted readers, before any of it is loaded
    verify_checkpoint(ckpt, rank_files=os.path.basename(rank_file) if same_layout else None)
    load_model_weights(ctx.model, ckpt, replicated_encoder_rank=encoder_replica_rank(ctx), spread_groups=dp_groups(ctx))
    ctx.optimizer.reload_model_params()
    load_optimizer(os.path.join(ckpt, OPTIMIZER_DIR), ctx, sharding=saved_format(meta))
    if same_layout:
        from mimo_sft.parallel.groups import megatron_ranks

        said = runtime.restore_rng(load_rank_file(rank_file), seed=ctx.cfg.train.seed, step=int(meta["step"]),
                                   ranks=megatron_ranks(ctx.pstate))
        if said and dist.get_rank() == 0:
            print(f"mimo-sft: {said}", flush=True)
    elif dist.get_rank() == 0:
        print(f"mimo-sft: resuming on another layout: RNG streams restart from the seed; weights, optimizer state, "
              f"step {meta['step']} and data position ({meta['consumed_samples']} samples) are restored "
              f"(saved with {_fmt_layout(saved_layout or [])})", flush=True)
    return int(meta["step"]), int(meta["consumed_samples"])


def bucket_meta(ctx) -> dict:
    """The language and vision modules' DDP bucket sizes as built (``train.buckets``, ``train.setup``: a
    DP-reshardable optimizer state resumes only into the same buckets); the same on every rank, so rank 0
    can write them."""
    from mimo_sft.train.buckets import META_KEY
    from mimo_sft.train.setup import VISION_META_KEY

    return {META_KEY: ctx.language_bucket_size, VISION_META_KEY: getattr(ctx, "vision_bucket_size", None)}


def _optimizer_kind(ctx) -> dict:
    """What the optimizer checkpoint's keys depend on (the layout they do not)."""
    return {"use_distributed_optimizer": distributed_optimizer_in_use(ctx.cfg),
            "dtype": ctx.cfg.model.dtype}


def _fmt_layout(sig: list[dict]) -> str:
    return " ".join(f"{m['name']}=tp={m['tp']},pp={m['pp']},cp={m['cp']},dp={m['dp']},"
                    + (f"ep={m['ep']},etp={m['etp']}," if m.get("ep", 1) > 1 else "") + f"rank_offset={m['rank_offset']}"
                    for m in sig)
