"""The model's side of a checkpoint: wrapper-free sharded state dicts and the layout signature.

Shared by :mod:`checkpoint` (weights, meta) and :mod:`optimizer` (whose map is built
from the same model state dict), so that neither imports the other.
"""

from __future__ import annotations

from contextlib import contextmanager

from mimo_sft.train.checkpoint.lora import has_lora, trainable_entries


def layout_signature(layout) -> list[dict]:
    """Each module's partition as saved in meta.json: tp, pp, cp, dp, the expert tp in force, rank_offset,
    and ep where it is > 1 (a dense layout's entry reads as before expert parallelism existed)."""
    out = []
    for s in layout.components:
        entry = {"name": s.name, "dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp}
        if s.ep > 1:
            entry["ep"] = s.ep
        out.append({**entry, "etp": s.expert_tp, "rank_offset": s.rank_offset})
    return out


@contextmanager
def unwrapped(model):
    """``model`` with its DDP wrappers taken off for the duration (parameters are shared).

    Checkpoint keys then name the model, not the training wrappers ("language_model.decoder...",
    not "language_model.module.decoder..."), so a checkpoint loads into a model built for export or
    for another layout.
    """
    saved = {}
    if getattr(model.language_model, "module", None) is not None and hasattr(model.language_model, "no_sync"):
        saved["language"] = model.language_model
        model.language_model = model.language_model.module
    for name in list(model.modality_submodules.keys()):
        sub = model.modality_submodules[name]
        if getattr(sub, "module", None) is not None and hasattr(sub, "no_sync"):
            saved[name] = sub
            model.modality_submodules[name] = sub.module
    try:
        yield model
    finally:
        for name, wrapper in saved.items():
            if name == "language":
                model.language_model = wrapper
            else:
                model.modality_submodules[name] = wrapper


def model_sharded_state_dict(model, replicated_encoder_rank: int = 0) -> dict:
    """The model's sharded state dict with wrapper-free keys.

    ``replicated_encoder_rank``: this rank's tp coordinate in an encoder whose (unsharded) tower is
    replicated over tp ranks (colocated fan-out). Megatron marks those tensors as replica 0 on every
    tp rank; all but tp rank 0 are re-marked as replicas so exactly one rank writes each tensor.
    """
    with unwrapped(model) as bare:
        sd = bare.sharded_state_dict()
        if has_lora(bare):  # a LoRA checkpoint holds what trains; the base weights stay in --hf-model
            sd = trainable_entries(sd)
    mark_encoder_replicas(sd, replicated_encoder_rank)
    return sd


def mark_encoder_replicas(sd: dict, replicated_encoder_rank: int) -> None:
    """Re-mark a replicated encoder's tensors as replicas on every tp rank but 0 (see
    :func:`model_sharded_state_dict`), in place. A save and a load both need it: megatron's load
    validates that exactly one rank holds replica 0 of each tensor, as its save does."""
    if not replicated_encoder_rank:
        return
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, ShardedBase) and node.key.startswith("modality_submodules."):
            rid = node.replica_id if isinstance(node.replica_id, tuple) else (node.replica_id,)
            node.replica_id = (replicated_encoder_rank, *rid[1:]) if len(rid) > 1 else (replicated_encoder_rank,)

    walk(sd)


def encoder_replica_rank(ctx) -> int:
    """tp coordinate of this rank in a replicated (tp > 1) encoder, else 0."""
    for spec in ctx.layout.encoders:
        c = ctx.layout.coords(ctx.rank).get(spec.name)
        if c is not None and spec.tp > 1:
            return c.tp
    return 0
