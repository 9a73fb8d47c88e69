"""Checks 15, 24, 34 and 35: the checkpoint flags, checkpoint-writing settings (and whether the checkpoints a run
keeps fit the disk: :func:`checkpoint_bytes`), whether ``--load-checkpoint`` can resume on this layout, the export's
shard size, and whether a resume's flags keep the saved data order.

The resharding rule lives here, pure (a checkpoint's ``meta.json`` against a layout), so that
``validate``, ``finetune`` (before any tensor is read) and ``mimo-sft checkpoint info --component``
give the same answer.
"""

from __future__ import annotations

import json
import os
import shutil

from mimo_sft.config.lora import distributed_optimizer_in_use

#: the distributed optimizer's DP-only format (``train.checkpoint.optimizer``): its flat buffers
#: follow each module's TP/PP-local parameters
DP_ONLY_FORMAT = "dp_reshardable"
#: megatron's own reshardable form, gathered on every DP rank (what --save-reshardable wrote before
#: ``fully_reshardable_boxes``; also what a meta.json without the key holds)
GATHERED_FORMAT = "fully_reshardable"


def reshard_problem(meta: dict, components) -> str | None:
    """Why a checkpoint with ``meta`` cannot resume on ``components`` (objects or dicts with name,
    tp, pp), or None. Weights, plain-optimizer state and the reshardable distributed-optimizer
    form resume on any layout; the DP-only form needs each module's TP and PP as saved. A mixture-of-experts
    model's experts have an optimizer of their own only where megatron splits them off (ep > 1, or etp
    other than tp): a checkpoint saved with them among the dense parameters cannot resume on such a layout."""
    saved = {m["name"]: m for m in meta.get("layout", [])}
    for c in components:
        name, tp, ep, etp = ((c["name"], c["tp"], c.get("ep", 1), c.get("etp", c["tp"])) if isinstance(c, dict)
                             else (c.name, c.tp, c.ep, c.expert_tp))
        was = saved.get(name)
        if was is not None and _experts_apart(ep, etp, tp) and not _experts_apart(
                was.get("ep", 1), was.get("etp", was["tp"]), was["tp"]):
            return (f"it was saved with {name} ep={was.get('ep', 1)},etp={was.get('etp', was['tp'])} (the experts' "
                    f"optimizer state with the dense parameters'), which megatron keeps apart at ep={ep},etp={etp}; "
                    f"resume with ep=1 and etp=tp, or start from its weights with --pretrained-checkpoint")
    if not meta.get("use_distributed_optimizer") or meta.get("distributed_optimizer_format") != DP_ONLY_FORMAT:
        return None
    for c in components:
        if isinstance(c, dict):
            name, tp, pp, ep, etp = c["name"], c["tp"], c["pp"], c.get("ep", 1), c.get("etp", c["tp"])
        else:
            name, tp, pp, ep, etp = c.name, c.tp, c.pp, c.ep, c.expert_tp
        was = saved.get(name)
        if was is None:
            return f"it holds no {name} module"
        if (was["tp"], was["pp"]) != (tp, pp):
            return (f"its distributed-optimizer state was saved in the DP-only form with {name} tp={was['tp']},"
                    f"pp={was['pp']}, which resumes only with that TP and PP (this layout has tp={tp},pp={pp}); "
                    f"resume on the saved TP/PP (any DP), or re-save it there with --save-reshardable")
        was_ep = was.get("ep", 1)
        if was_ep != ep or (max(was_ep, ep) > 1 and was.get("etp", was["tp"]) != etp):
            return (f"its distributed-optimizer state was saved in the DP-only form with {name} ep={was_ep},"
                    f"etp={was.get('etp', was['tp'])}, which resumes only with that expert layout (this layout has "
                    f"ep={ep},etp={etp}); resume with the saved ep and etp, or re-save it there with --save-reshardable")
    return None


def _experts_apart(ep: int, etp: int, tp: int) -> bool:
    """Whether megatron gives expert parameters their own optimizer (``ColumnParallelLinear``'s
    ``use_expert_pgs``: expert parallelism, or an expert TP other than the TP)."""
    return ep > 1 or etp != tp


def find_meta(path: str) -> dict | None:
    """``meta.json`` of the checkpoint ``path`` names (the folder, or the one its ``latest`` names); None if unreadable."""
    for folder in (path, os.path.join(path, _latest(path) or ""), os.path.join(path, "checkpoints", _latest(
            os.path.join(path, "checkpoints")) or "")):
        try:
            with open(os.path.join(folder, "meta.json")) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            continue
    return None


def _latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest")) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def c15_checkpoints(ctx):
    c = ctx.cfg.checkpoint
    if c.load_checkpoint and ctx.cfg.model.pretrained_checkpoint:
        yield ("--load-checkpoint and --pretrained-checkpoint are exclusive: resume a run with "
               "--load-checkpoint, or start fresh from weights with --pretrained-checkpoint")
    if c.no_save:
        t = ctx.cfg.train
        needs = [flag for flag, value in (("--save", c.save), ("--save-interval", c.save_interval),
                                          ("--export-hf", c.export_hf), ("--exit-signal-handler", t.exit_signal_handler),
                                          ("--exit-interval", t.exit_interval),
                                          ("--exit-duration-in-mins", t.exit_duration_in_mins)) if value]
        if needs:
            yield (f"--no-save with {', '.join(needs)}: those write or need a checkpoint; drop --no-save to keep "
                   f"the weights, or drop {', '.join(needs)}")
    if c.recorded:  # what the loader took from the checkpoint the run starts from (config.recorded)
        yield c.recorded, "note"
    for flag, path in (("--load-checkpoint", c.load_checkpoint if c.load_checkpoint != "auto" else None),
                       ("--pretrained-checkpoint", ctx.cfg.model.pretrained_checkpoint)):
        if path and not os.path.isdir(path):
            yield f"{flag} {path}: folder not found"


def c24_checkpoint_writing(ctx):
    c = ctx.cfg.checkpoint
    if c.async_save and not c.save_interval:
        yield ("--async-save without --save-interval: the only save is the final one, which the run waits for; "
               "add --save-interval N for background saves", "note")
    if c.save_reshardable and not distributed_optimizer_in_use(ctx.cfg):
        why = "with LoRA (its optimizer is the plain one)" if ctx.cfg.optimizer.use_distributed_optimizer else \
            "without the distributed optimizer"
        yield (f"--save-reshardable has no effect {why}: a plain optimizer's checkpoint resumes on any layout", "note")
    if c.load_checkpoint and ctx.specs and os.path.isdir(c.load_checkpoint):
        meta = find_meta(c.load_checkpoint)
        problem = reshard_problem(meta, ctx.specs) if meta else None
        if problem:
            yield f"--load-checkpoint {c.load_checkpoint}: {problem}"
        if meta and meta.get("use_distributed_optimizer") and meta.get("distributed_optimizer_format",
                                                                        GATHERED_FORMAT) == GATHERED_FORMAT:
            yield (f"--load-checkpoint {c.load_checkpoint}: its distributed-optimizer state was written by megatron's "
                   f"gather (an older --save-reshardable), which in megatron-core 0.19.2 stores the state of the "
                   f"parameters after a module's first gradient bucket shifted by the bucket padding; it resumes exactly "
                   f"only if every module had one bucket, else start from its weights with --pretrained-checkpoint "
                   f"{c.load_checkpoint}", "note")
    yield from _disk_notes(ctx)


def checkpoint_bytes(cfg, memory: dict | None) -> int | None:
    """Bytes of one checkpoint's tensors, from check 23's forecast (``memory``: each module's whole
    parameter count, and its most loaded rank's held parameters and gradient bytes, 4 per trainable
    parameter); None without a forecast. Weights in the run's dtype (a LoRA run's: only what trains,
    :mod:`train.checkpoint.lora`), and per trainable parameter the fp32 Adam moments plus the fp32 main
    weight (the distributed optimizer stores it in either dtype, the plain one for bf16 parameters)."""
    if not memory or not memory.get("modules"):
        return None
    bf16 = cfg.model.dtype == "bf16"
    lora = int(cfg.model.lora_rank or 0) > 0
    per_trainable = 12 if (bf16 or distributed_optimizer_in_use(cfg)) else 8
    total = 0
    for module in memory["modules"].values():
        held = module.get("rank_parameters") or 0
        trainable = round(module["parameters"] * module["terms"].get("gradients", 0) / 4 / held) if held else 0
        total += (trainable if lora else module["parameters"]) * (2 if bf16 else 4) + trainable * per_trainable
    return total


def _saves(cfg) -> int:
    """Checkpoints a run writes: every ``--save-interval`` steps and the last step."""
    iters, every = cfg.train.train_iters, cfg.checkpoint.save_interval
    return iters // every + (1 if iters % every else 0) if every and every > 0 else 1


def _free_bytes(folder: str) -> int | None:
    """Free bytes on the disk ``folder`` will be on (its nearest existing parent's)."""
    path = os.path.abspath(folder)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.0f} kB"


def _disk_notes(ctx):
    """A note when the checkpoints this run keeps at once do not fit the free space of the disk the save
    folder is on (validate may run on another machine than the run, hence a note, not an error)."""
    c = ctx.cfg.checkpoint
    size = checkpoint_bytes(ctx.cfg, ctx.memory)
    if c.no_save or not size:
        return
    folder = c.save or os.path.join(ctx.cfg.logging.output_dir, "checkpoints")
    free = _free_bytes(folder)
    saves, keep = _saves(ctx.cfg), c.keep_last_checkpoints
    at_once = min(saves, keep + 1) if keep else saves  # the newest N and the one being written
    if free is None or at_once * size <= free:
        return
    fit = max(0, free // size - 1)
    if keep:
        fix = f"lower --keep-last-checkpoints to {fit}" if fit >= 1 else "free space there"
        yield (f"--keep-last-checkpoints {keep}: {at_once} checkpoints of about {_size(size)} each ({_size(at_once * size)}) "
               f"are on disk at once while saving, more than the {_size(free)} free where {folder} is; {fix} or point "
               f"--save at a disk with room", "note")
        return
    fix = f"add --keep-last-checkpoints N (N <= {fit} fits)" if fit >= 1 else "free space there"
    yield (f"--keep-last-checkpoints is unset, so all {saves} checkpoints of this run are kept: about {_size(size)} each, "
           f"{_size(saves * size)} in all, more than the {_size(free)} free where {folder} is; {fix}, raise "
           f"--save-interval, or point --save at a disk with room", "note")


def shard_size_bytes(size) -> int:
    """``--export-shard-size`` (bytes, or a size such as ``5GB``/``500MB`` as transformers' ``max_shard_size``
    takes it, parsed by huggingface_hub) -> bytes; ValueError naming the flag when it is not a positive size."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(size).strip()
    try:
        n = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"--export-shard-size {size}: give a positive size such as 5GB, 500MB or a byte count")
    return n


#: meta.json's key for the settings the training sample stream depends on (written by ``train.checkpoint.save``)
DATA_ORDER_KEY = "data_order"


def data_order_meta(cfg) -> dict:
    """What a save records so that check 35 can compare a resume's flags before any process starts.
    ``global_batch_size`` is kept for information only: it changes how many samples a step takes, not
    which sample comes next (``consumed_samples`` is a position in a stream of micro-batches)."""
    t, d = cfg.train, cfg.data
    order = {"micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
             "seed": t.seed, "dataloader_type": d.dataloader_type, "drop_last": d.drop_last}
    sources = _sources(d)
    if sources is not None:  # a mixture: its interleave follows the shares (data.mixture)
        order["sources"] = sources
    return {DATA_ORDER_KEY: order}


def _sources(data_cfg) -> list | None:
    """A mixture's ``[{name, path, share}]`` (None: one dataset, or settings check 17 refuses)."""
    from mimo_sft.config.mixture import mixture_problems, mixture_specs

    if not data_cfg.datasets or mixture_problems(data_cfg):
        return None
    return [{"name": s.name, "path": resolved_path(s.data.dataset_path), "share": round(s.weight, 12)}
            for s in mixture_specs(data_cfg)]


def resolved_path(path) -> str:
    """A local path as one spelling (absolute, links resolved; a glob's folder resolved): ``./data/a.jsonl`` and
    ``/abs/data/a.jsonl`` are the same source. A hub name or a path that does not exist is kept as given."""
    text = os.path.expanduser(str(path))
    if any(ch in text for ch in "*?["):
        folder, pattern = os.path.split(text)
        return os.path.join(os.path.realpath(folder or "."), pattern) if os.path.isdir(folder or ".") else str(path)
    return os.path.realpath(text) if os.path.exists(text) else str(path)


def _source_differences(saved: list | None, now: list | None) -> list[str]:
    """What differs between a checkpoint's mixture and this run's, source by source (position, resolved path
    and share: the interleave follows the positions and shares; names are labels and may change)."""
    if not saved and not now:
        return []
    if not saved or not now:
        return ["one dataset then" if not saved else "one dataset now"]
    if len(saved) != len(now):
        return [f"{len(saved)} sources then, {len(now)} now"]
    out = []
    for k, (was, is_) in enumerate(zip(saved, now), 1):
        if resolved_path(was["path"]) != is_["path"]:
            out.append(f"source {k} ({is_['name']}) was {was['path']}, now {is_['path']}")
        if was["share"] != is_["share"]:
            out.append(f"source {k} ({is_['name']}) had share {was['share']:.4g}, now {is_['share']:.4g}")
    return out


def data_order_problems(saved: dict, cfg, path: str):
    """Why resuming the checkpoint at ``path`` (whose meta.json ``data_order`` is ``saved``) with ``cfg`` would
    read other samples next than the saved run would have (``data.sampler``), one line per flag; an entry
    absent from ``saved`` (a checkpoint written before it was recorded) is unknown and passes.

    Why each one matters: an epoch holds ``floor(N / micro_batch_size)`` whole micro-batches (``--drop-last``)
    or is filled up to a whole one (``--no-drop-last``), so both decide where epoch boundaries fall in the stream
    ``consumed_samples`` counts; ``cyclic`` shuffles each epoch with the seed, and ``--valid-split`` holds out a
    seeded choice of rows, so there the seed decides which rows the positions name."""
    t, d = cfg.train, cfg.data
    fix = f"or start from its weights with --pretrained-checkpoint {path} instead of --load-checkpoint"
    if saved.get("micro_batch_size") not in (None, t.micro_batch_size):
        was = saved["micro_batch_size"]
        yield (f"--micro-batch-size {t.micro_batch_size} differs from the checkpoint's {was} (an epoch holds whole "
               f"micro-batches, so its data position would name other samples): resume with --micro-batch-size {was}, {fix}")
    if saved.get("drop_last") not in (None, d.drop_last):
        now, was = (("--drop-last", "--no-drop-last") if d.drop_last else ("--no-drop-last", "--drop-last"))
        yield (f"{now} differs from the checkpoint's {was} (it moves the epoch boundaries of the data stream): "
               f"resume with {was}, {fix}")
    if saved.get("dataloader_type") not in (None, d.dataloader_type):
        was = saved["dataloader_type"]
        yield (f"--dataloader-type {d.dataloader_type} differs from the checkpoint's {was} (another sample order): "
               f"resume with --dataloader-type {was}, {fix}")
    now = _sources(d)
    differs = _source_differences(saved.get("sources"), now) if saved else []
    if differs:
        yield (f"the dataset mixture differs from the checkpoint's ({'; '.join(differs)}; its data position is a "
               f"position of that mixture's interleave): resume with the same sources in the same order and the same "
               f"--dataset-weights, {fix}")
    seeded = [why for why, on in (("--dataloader-type cyclic shuffles each epoch with it", d.dataloader_type == "cyclic"),
                                  ("a dataset mixture interleaves its sources with it", bool(now)),
                                  ("--valid-split holds out rows chosen with it", d.valid_split is not None)) if on]
    if seeded and saved.get("seed") not in (None, t.seed):
        was = saved["seed"]
        yield (f"--seed {t.seed} differs from the checkpoint's {was} ({'; '.join(seeded)}): "
               f"resume with --seed {was}, {fix}")


def c35_resumed_data_order(ctx):
    c = ctx.cfg.checkpoint
    if c.load_checkpoint and os.path.isdir(c.load_checkpoint):
        meta = find_meta(c.load_checkpoint) or {}
        saved = meta.get(DATA_ORDER_KEY)
        yield from data_order_problems(saved if isinstance(saved, dict) else {}, ctx.cfg, c.load_checkpoint)


def c34_export_shards(ctx):
    try:
        shard_size_bytes(ctx.cfg.checkpoint.export_shard_size)
    except ValueError as err:
        yield str(err)
