"""``mimo-sft checkpoint info DIR``: what a checkpoint holds, read from its metadata alone.

``meta.json`` gives the step, data position, layout, dtype and optimizer kind; each part's
torch-dist ``.metadata`` (the index megatron's writer leaves next to the shards) gives every
tensor's global shape and dtype, summed here per module. No tensor is read, and neither megatron
nor a process group is needed, so it answers in about a second for a checkpoint of any size.
``--component`` asks whether the checkpoint resumes on that layout (the rule of check 24,
:func:`config.checks.checkpoint.reshard_problem`). The metadata is read through
:mod:`trusted`'s restricted unpickler; ``--verify`` also checks every stored object, rank file and data
file size a load would read (:func:`trusted.verify_checkpoint`).
"""

from __future__ import annotations

import os

from mimo_sft.config.checks.checkpoint import reshard_problem
from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint
from mimo_sft.train.checkpoint.trusted import PARTS, trusted_part, verify_checkpoint


def _module_of(key: str) -> str:
    for prefix in ("optimizer.mimo.", "mimo."):
        if key.startswith(prefix):
            return key[len(prefix):].split(".", 1)[0]
    if key.startswith("language_model."):
        return "language"
    if key.startswith("modality_submodules."):
        return key.split(".", 2)[1]
    return "other"


def part_sizes(folder: str) -> dict[str, int]:
    """Bytes of the tensors in one dist-checkpoint part, per module, from its ``.metadata`` index."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sizes: dict[str, int] = {}
    metadata = trusted_part(folder)
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            numel = 1
            for dim in item.size:
                numel *= dim
            nbytes = numel * torch.empty((), dtype=item.properties.dtype).element_size()
            module = _module_of(key)
            sizes[module] = sizes.get(module, 0) + nbytes
    return sizes


def _bytes_on_disk(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _dirs, files in os.walk(folder) for f in files)


def describe(path: str, components=None, *, verify: bool = False) -> dict:
    """The facts ``checkpoint info`` prints, as one JSON-able object. ``verify``: every file a load would
    read is checked first (:func:`trusted.verify_checkpoint`); a problem is the ``UserError`` it raises."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    verified = verify_checkpoint(ckpt) if verify else None
    distributed = bool(meta.get("use_distributed_optimizer"))
    fmt = meta.get("distributed_optimizer_format", "fully_reshardable") if distributed else None
    modules: dict[str, dict[str, int]] = {}
    for part in PARTS:
        folder = os.path.join(ckpt, part)
        if not os.path.isfile(os.path.join(folder, ".metadata")):
            continue
        for module, nbytes in part_sizes(folder).items():
            modules.setdefault(module, {})[f"{part}_bytes"] = nbytes
    info = {
        "checkpoint": ckpt, "step": meta["step"], "consumed_samples": meta.get("consumed_samples"),
        "world_size": meta.get("world_size"), "layout": meta.get("layout", []), "dtype": meta.get("dtype"),
        "optimizer": "distributed" if distributed else "plain", "distributed_optimizer_format": fmt,
        "reshardable": _resume_rule(fmt, meta.get("layout", [])),
        "sources": _sources(meta),
        "lora": bool(meta.get("lora")), "hf_model": meta.get("hf_model"), "modules": modules,
        "bytes_on_disk": {part: _bytes_on_disk(os.path.join(ckpt, part)) for part in PARTS
                          if os.path.isdir(os.path.join(ckpt, part))},
    }
    if verified is not None:
        info["verified"] = verified
    if components:
        problem = reshard_problem(meta, components)
        info["resumes_on"] = {"layout": [c.to_flag() for c in components], "ok": problem is None,
                              "reason": problem}
    return info


def _resume_rule(fmt: str | None, layout: list[dict]) -> str:
    """Which layouts the checkpoint resumes on, in words (the rule of :func:`reshard_problem`)."""
    if fmt != "dp_reshardable":
        return "any layout"
    experts = any(m.get("ep", 1) > 1 for m in layout)
    return "any DP size; TP, PP, EP and expert TP as saved" if experts else "any DP size; TP and PP as saved"


def _sources(meta: dict) -> list[dict]:
    """A mixture's sources: name, path, share, rows and how many samples of each the run had drawn (its
    position), from meta.json's ``data_order.sources`` and ``mixture`` (empty: one dataset)."""
    saved = (meta.get("data_order") or {}).get("sources") or []
    mixture = meta.get("mixture") or {}
    rows = mixture.get("rows") or []
    if not saved:
        return []
    out = [dict(s) for s in saved]
    if len(rows) == len(saved) and all(r > 0 for r in rows):
        from mimo_sft.data.mixture import MixtureOrder, resumed_interleave

        seed = int((meta.get("data_order") or {}).get("seed") or 0)  # (the shuffled rule's chunks follow it)
        order = MixtureOrder(rows, [s["share"] for s in saved], seed=seed, shuffle=False,
                             interleave=resumed_interleave(mixture) or "deficit")
        for one, r, drawn in zip(out, rows, order.draws_before(int(meta.get("consumed_samples") or 0))):
            one.update(rows=r, drawn=drawn, epochs=round(drawn / r, 4))
    return out


def format_info(info: dict) -> str:
    gib = 2 ** 30
    lines = [f"{info['checkpoint']}: step {info['step']}, {info['consumed_samples']} samples consumed",
             "layout: " + " ".join(f"{m['name']}=tp={m['tp']},pp={m['pp']},cp={m['cp']},dp={m['dp']},"
                                   + (f"ep={m['ep']},etp={m['etp']}," if m.get("ep", 1) > 1 else "")
                                   + f"rank_offset={m['rank_offset']}" for m in info["layout"])
             + f" ({info['world_size']} ranks)",
             f"dtype: {info['dtype']}; optimizer: {info['optimizer']}"
             + (f" ({info['distributed_optimizer_format']})" if info["distributed_optimizer_format"] else "")
             + f"; resumes on {info['reshardable']}" + ("; LoRA" if info["lora"] else "")]
    for name, sizes in sorted(info["modules"].items()):
        lines.append(f"  {name}: weights {sizes.get('model_bytes', 0) / gib:.3f} GiB, optimizer state "
                     f"{sizes.get('optimizer_bytes', 0) / gib:.3f} GiB")
    lines.append("on disk: " + ", ".join(f"{p} {n / gib:.3f} GiB" for p, n in info["bytes_on_disk"].items()))
    for s in info["sources"]:
        where = (f", {s['rows']} rows, {s['drawn']} drawn ({s['epochs']:.2f} epochs)" if "rows" in s else "")
        lines.append(f"  source {s['name']}: {s['path']}, share {100 * s['share']:.1f}%{where}")
    if "verified" in info:
        v = info["verified"]
        lines.append(f"verified: {v['parts']} parts, {v['data_files']} data files (sizes), {v['objects']} stored "
                     f"objects and {v['rank_files']} rank files read as plain data; nothing refused")
    if "resumes_on" in info:
        r = info["resumes_on"]
        lines.append(f"resume on {' '.join(r['layout'])}: " + ("yes" if r["ok"] else f"no: {r['reason']}"))
    return "\n".join(lines)
