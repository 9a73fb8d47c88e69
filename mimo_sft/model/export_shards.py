"""Sharded safetensors as transformers writes them, filled group by group (a decoder layer at a time).

Why planned up front: an export must never hold the whole model, yet the shard files are named
``model-0000K-of-0000N.safetensors`` and the index lists every tensor's file, so the plan is made
first from shapes alone (meta tensors in the export dtype) with the same function transformers'
``save_pretrained(max_shard_size=...)`` calls (``huggingface_hub.split_torch_state_dict_into_shards``),
over the tensors in the order transformers saves them (its state dict, tied weights removed, through
``revert_weight_conversion``, computed on a model built on the meta device). The same names, sizes,
order and limit give the same files, the same ``weight_map`` and the same ``metadata`` (``total_size``,
``total_parameters``) as transformers, so a re-save with transformers changes nothing.

:class:`ShardWriter` then takes the real tensors in any grouping whose order follows the plan (a
layer's tensors are consecutive in transformers' order) and writes each shard as soon as its last
tensor arrives: host memory holds the current shard's tensors plus the group being added.
"""

from __future__ import annotations

import json
import os

import torch

from mimo_sft.config.schema import CheckpointConfig
from mimo_sft.errors import UserError
from mimo_sft.model.hf_checkpoint import SAFE_INDEX, SAFE_SINGLE

#: ``--export-shard-size``'s default (the schema's): the shard size of the Qwen-VL checkpoints on the
#: Hub and of transformers 4's ``save_pretrained`` (transformers 5 writes 50GB unless told otherwise)
DEFAULT_SHARD_SIZE = CheckpointConfig.export_shard_size
_FILENAME_PATTERN = SAFE_SINGLE.replace(".safetensors", "{suffix}.safetensors")


def shard_size_bytes(size) -> int:
    """``--export-shard-size`` -> bytes (the rule is check 34's, ``config.checks.checkpoint``); UserError when bad."""
    from mimo_sft.config.checks.checkpoint import shard_size_bytes as parse

    try:
        return parse(size)
    except ValueError as err:
        raise UserError(str(err)) from None


def transformers_save_order(hf_cfg) -> list[str]:
    """The tensor names, in order, that transformers' ``save_pretrained`` writes for ``hf_cfg``
    (computed on a model built on the meta device: no memory, no weights)."""
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf_cfg)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return list(revert_weight_conversion(model, state))


def order_like_transformers(names, hf_cfg) -> list[str]:
    """``names`` in transformers' save order; names it does not write (a source folder in the
    ``model.visual.*`` naming) follow in transformers' own load order (``dot_natural_key``)."""
    from transformers.core_model_loading import dot_natural_key

    position = {name: i for i, name in enumerate(transformers_save_order(hf_cfg))}
    return sorted(names, key=lambda n: (position.get(n, len(position)), dot_natural_key(n)))


def plan_shards(meta_tensors: dict, max_shard_bytes: int):
    """transformers' shard plan (``StateDictSplit``) for ``meta_tensors`` (name -> meta tensor in the
    export dtype, in save order)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    return split_torch_state_dict_into_shards(meta_tensors, filename_pattern=_FILENAME_PATTERN,
                                              max_shard_size=max_shard_bytes)


class ShardWriter:
    """Writes the shards of ``plan`` into ``out_dir`` as their tensors are added (see module doc)."""

    def __init__(self, out_dir: str, plan, meta_tensors: dict):
        self.out_dir, self.plan, self.meta = out_dir, plan, meta_tensors
        self._pending: dict[str, torch.Tensor] = {}
        self._written: list[str] = []
        self._files = list(plan.filename_to_tensors)

    def add(self, tensors: dict) -> None:
        """Take ``tensors`` (HF names, export dtype); write every shard they complete."""
        for name, t in tensors.items():
            want = self.meta.get(name)
            assert want is not None and name not in self._pending, f"export: unplanned or repeated tensor {name}"
            assert tuple(t.shape) == tuple(want.shape) and t.dtype == want.dtype, (
                f"export: {name} is {tuple(t.shape)} {t.dtype}, planned {tuple(want.shape)} {want.dtype}")
            self._pending[name] = t
        while len(self._written) < len(self._files):
            fname = self._files[len(self._written)]
            names = self.plan.filename_to_tensors[fname]
            if not all(n in self._pending for n in names):
                break
            self._write(fname, {n: self._pending.pop(n) for n in names})

    def _write(self, fname: str, shard: dict) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(self.out_dir, fname), metadata={"format": "pt"})
        self._written.append(fname)

    def finish(self) -> list[str]:
        """Write the index (when sharded); returns the files written. Every planned tensor must have come."""
        assert len(self._written) == len(self._files) and not self._pending, (
            f"export: shards {self._files[len(self._written):][:3]} incomplete, {sorted(self._pending)[:3]} left over")
        if not self.plan.is_sharded:
            return list(self._written)
        index = {"metadata": {"total_parameters": sum(t.numel() for t in self.meta.values()), **self.plan.metadata},
                 "weight_map": self.plan.tensor_to_filename}
        with open(os.path.join(self.out_dir, SAFE_INDEX), "w", encoding="utf-8") as fh:
            fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return self._written + [SAFE_INDEX]
