"""Reading a local Hugging Face checkpoint folder: config.json and safetensors shards.

Each rank opens the shards lazily and reads only the slices it needs (``safe_open(...).get_slice``),
so a TP rank never materialises another rank's part of a large tensor. Every problem a user can fix
(missing folder, missing config.json, missing or corrupt shard, a tensor the config implies but the
weights lack, a tensor of the wrong shape) is raised as a one-line ``UserError`` that names the path
and what to change.

Names are kept exactly as stored; families translate them (see ``family.py``). Both the layout
transformers writes (``visual.*``, ``model.layers.*``) and the one it uses in memory
(``model.visual.*``, ``model.language_model.*``) are read; ``prefix_style`` records which one the
folder uses so an export can write the same names back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

import torch

from mimo_sft.errors import UserError

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
#: weights stored as pickles (``pytorch_model.bin`` and kin): never read, named in the refusal
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config_json(hf_dir: str) -> dict:
    """The raw config.json of ``hf_dir`` (UserError when the folder or file is missing or bad)."""
    if not hf_dir:
        raise UserError("no model folder given; pass --hf-model DIR (a Hugging Face checkpoint folder)")
    if not os.path.isdir(hf_dir):
        raise UserError(f"model folder {hf_dir} does not exist; pass --hf-model a folder that holds config.json and *.safetensors")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; --hf-model must be a Hugging Face checkpoint folder with config.json and *.safetensors")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err.__class__.__name__}: {err}); restore the checkpoint's config.json") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} does not hold a JSON object; restore the checkpoint's config.json")
    return cfg


#: safetensors header dtype codes -> torch dtypes (what Qwen-VL checkpoints hold)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass
class _Entry:
    file: str
    shape: tuple


class HFCheckpoint:
    """Lazy, sliced access to the tensors of one checkpoint folder."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self._entries: dict[str, _Entry] = {}
        self._handles: dict[str, object] = {}
        self._scan()

    # ---- discovery -------------------------------------------------------------------------
    def _shard_files(self) -> list[str]:
        index = os.path.join(self.hf_dir, SAFE_INDEX)
        single = os.path.join(self.hf_dir, SAFE_SINGLE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{index} is not a valid safetensors index ({err.__class__.__name__}); restore it from the checkpoint") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.isfile(os.path.join(self.hf_dir, name)):
                    raise UserError(f"{os.path.join(self.hf_dir, name)} is missing (listed in {SAFE_INDEX}); download the complete checkpoint")
            return files
        if os.path.isfile(single):
            return [SAFE_SINGLE]
        others = sorted(n for n in os.listdir(self.hf_dir) if n.endswith(".safetensors"))
        if others:
            return others
        pickled = sorted(n for n in os.listdir(self.hf_dir) if n.endswith(PICKLED_WEIGHTS))
        if pickled:
            raise UserError(f"{self.hf_dir} holds its weights only as pickles ({', '.join(pickled[:3])}"
                            f"{', ...' if len(pickled) > 3 else ''}), which mimo-sft does not read: loading a pickle "
                            f"can run code from it. Convert them to safetensors where you trust the files (transformers: "
                            f"model.save_pretrained(DIR, safe_serialization=True)) and point --hf-model at DIR")
        raise UserError(f"{self.hf_dir} holds no *.safetensors weights; add the checkpoint's weights (finetune can start without them: --allow-random-init)")

    def _scan(self) -> None:
        from safetensors import safe_open

        for name in self._shard_files():
            path = os.path.join(self.hf_dir, name)
            try:
                handle = safe_open(path, framework="pt")
                keys = list(handle.keys())
                shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in keys}
            except Exception as err:  # safetensors raises several types for truncated / bad headers
                raise UserError(f"{path} is not a readable safetensors file ({err.__class__.__name__}: {str(err).splitlines()[0] if str(err) else ''}); re-download or re-export it") from None
            self._handles[name] = handle
            for k in keys:
                self._entries[k] = _Entry(name, shapes[k])

    # ---- queries ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple:
        return self._entry(name).shape

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with ``name``'s shape and dtype (from the file header: nothing is read)."""
        entry = self._entry(name)
        if entry.file not in self._handles:
            from safetensors import safe_open

            self._handles[entry.file] = safe_open(os.path.join(self.hf_dir, entry.file), framework="pt")
        code = self._handles[entry.file].get_slice(name).get_dtype()
        return torch.empty(entry.shape, dtype=_SAFETENSORS_DTYPES[code], device="meta")

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UserError(f"{self.hf_dir}: tensor '{name}' is missing from the safetensors weights although config.json implies it; "
                            f"the config and the weights disagree (use the config.json that came with these weights)") from None

    def expect_shape(self, name: str, shape: Sequence[int]) -> None:
        got = self.shape(name)
        if tuple(got) != tuple(shape):
            raise UserError(f"{self.hf_dir}: tensor '{name}' has shape {list(got)} but config.json implies {list(shape)}; "
                            f"the config and the weights disagree (use the config.json that came with these weights)")

    def read(self, name: str, rows: Optional[tuple[int, int]] = None, cols: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """The tensor ``name``, or only rows ``[r0, r1)`` / columns ``[c0, c1)`` of it."""
        entry = self._entry(name)
        if entry.file not in self._handles:  # reopened after close(): the header is parsed again, nothing else
            from safetensors import safe_open

            self._handles[entry.file] = safe_open(os.path.join(self.hf_dir, entry.file), framework="pt")
        sl = self._handles[entry.file].get_slice(name)
        try:
            if rows is None and cols is None:
                return sl[:]
            r = slice(*rows) if rows else slice(None)
            if cols is None:
                return sl[r]
            return sl[r, slice(*cols)]
        except Exception as err:
            raise UserError(f"{os.path.join(self.hf_dir, entry.file)}: tensor '{name}' cannot be read ({err.__class__.__name__}); re-download or re-export the checkpoint") from None

    def close(self) -> None:
        """Unmap the shard files (reads reopen them). safetensors reads through a memory map, so every
        page read stays in this process's RSS while the file is open; the streamed load closes the
        files after each group, so the mapped pages are one group's, not the stage's."""
        self._handles.clear()

    def full_dict(self, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        return {n: self.read(n) for n in (names if names is not None else self.keys())}

    # ---- naming ----------------------------------------------------------------------------
    @property
    def prefix_style(self) -> str:
        """'legacy' (``visual.*`` / ``model.layers.*``) or 'nested' (``model.visual.*`` / ``model.language_model.*``)."""
        if any(k.startswith("model.language_model.") or k.startswith("model.visual.") for k in self._entries):
            return "nested"
        return "legacy"

    def shard_files(self) -> list[str]:
        return sorted({e.file for e in self._entries.values()})


def group_by_block(keys: Iterable[str]) -> list[list[str]]:
    """Keys grouped into reading units: every key under the same ``...layers.N.`` / ``blocks.N.`` (its
    path up to its first number) together, every other key alone. The streamed load and export read
    one such group at a time."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        groups.setdefault(".".join(parts[: cut + 1]) if cut is not None else key, []).append(key)
    return list(groups.values())


def iter_blocks(ckpt: HFCheckpoint, prefix: str) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors under ``prefix`` (names without it), read one block at a time (:func:`group_by_block`),
    for ``decoder_weights.copy_into``: host memory holds one block, not the tower."""
    for group in group_by_block(k for k in ckpt.keys() if k.startswith(prefix)):
        yield {k[len(prefix):]: ckpt.read(k) for k in group}


def one_group_mapped(ckpt: HFCheckpoint, groups: Iterable[dict]) -> Iterator[dict]:
    """``groups`` (read from ``ckpt``), with the shard files unmapped after each (:meth:`HFCheckpoint.close`)."""
    for group in groups:
        yield group
        ckpt.close()
