"""Reading a checkpoint runs none of its author's code.

A checkpoint folder comes from anywhere: a teammate's run, a shared cluster folder, a download. Three
kinds of pickle sit in one, and each is read under a rule that admits data only:

* each dist-checkpoint part's ``.metadata`` (torch DCP's index of the part): torch's
  ``FileSystemReader.read_metadata`` reads it with a plain ``pickle.load``. Here
  :class:`RestrictedUnpickler` reads it, admitting only the classes torch's own metadata is made of
  (:data:`METADATA_GLOBALS`);
* the byte items inside a part's ``.distcp`` files (megatron's ``ShardedObject``s: the common state,
  the optimizer's parameter groups, layers' extra state): torch's ``DefaultLoadPlanner.load_bytes``
  unpickles them with ``weights_only=False``. Here each is first read with ``weights_only=True``,
  torch's own restricted unpickler (tensors, numbers, strings, containers);
* our ``rank_NNNNN.pt`` (the RNG streams): read with ``weights_only=True`` (:func:`load_rank_file`).

megatron-core 0.19.2 offers no way to hand its load a reader: ``dist_checkpointing.load`` and
``load_tensors_metadata`` make torch's ``FileSystemReader`` themselves
(``strategies/torch.py: _get_filesystem_reader``, ``serialization.load_common_state_dict``). So every
part is checked by :func:`trusted_part` -- its metadata and every byte item through the rules above,
and every file the metadata names for its size -- immediately before it is handed to megatron, and
what megatron then unpickles is bytes that passed. Our own readers (``checkpoint info``, the streamed
export) take the checked metadata through :class:`TrustedReader` and unpickle nothing else.

A refusal is one line naming the file and the class it asked for (``UserError``), raised before any
of the file's objects is made.
"""

from __future__ import annotations

import io
import os
import pickle
import re

from mimo_sft.errors import UserError

METADATA = ".metadata"
#: a checkpoint's dist-checkpoint parts (folders)
PARTS = ("model", "optimizer")
#: what torch's DCP metadata (``Metadata`` and the save plans it keeps) is made of: module -> names
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and the dtypes (torch.float32, ...): :func:`_allowed`
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class RefusedClass(pickle.UnpicklingError):
    """A pickle asked for a class outside the allow-list (``.name`` is ``module.name``)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _allowed(module: str, name: str) -> bool:
    if name in METADATA_GLOBALS.get(module, ()):
        return True
    if module == "torch":
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    return False


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that makes only the classes in :data:`METADATA_GLOBALS`. Every way a
    pickle names a class or function (GLOBAL, STACK_GLOBAL, INST, OBJ, the copyreg extension codes)
    goes through ``find_class``; persistent ids have no loader and are refused by pickle itself."""

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise RefusedClass(f"{module}.{name}")
        return super().find_class(module, name)


def _refusal(path: str, what: str, err: Exception) -> UserError:
    if isinstance(err, RefusedClass):
        cls = err.name
    else:
        found = _GLOBAL.search(str(err))
        cls = found.group(1) if found else None
    if cls is not None:
        return UserError(f"{path}: refused to load {cls}: {what} holds only plain data, and loading this would run "
                         f"code from the file; do not use this checkpoint (it was not written by mimo-sft, or was "
                         f"altered since)")
    first = (str(err).strip().splitlines() or [""])[0][:160]
    return UserError(f"{path}: {what} cannot be read ({type(err).__name__}: {first}); the checkpoint is damaged: "
                     f"use another one")


def read_metadata(folder: str):
    """The DCP ``Metadata`` of the part ``folder``, made by :class:`RestrictedUnpickler`."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as fh:
            metadata = RestrictedUnpickler(fh).load()
    except FileNotFoundError:
        raise UserError(f"{path} is missing; the checkpoint is incomplete: use another one") from None
    except Exception as err:  # noqa: BLE001 -- any failure of an untrusted pickle is the file's, said in one line
        raise _refusal(path, "a checkpoint's metadata", err) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UserError(f"{path}: holds a {type(metadata).__name__}, not torch distributed-checkpoint metadata; "
                        f"the checkpoint is damaged: use another one")
    return metadata


def load_weights_only(source, path: str, what: str, allow: list | None = None):
    """``torch.load(source, weights_only=True)`` (plus the classes in ``allow``); a refusal or a damaged
    file is a one-line ``UserError`` naming ``path``."""
    import torch

    try:
        with torch.serialization.safe_globals(allow or []):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- as in read_metadata
        raise _refusal(path, what, err) from None


def _check_part(folder: str, metadata) -> int:
    """Every file the metadata names exists and holds its items; every byte item passes torch's
    weights-only unpickler. Returns the number of byte items checked."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sizes: dict[str, int] = {}
    checked = 0
    for index, info in metadata.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise UserError(f"{os.path.join(folder, METADATA)}: names a data file {rel!r} outside its folder; the "
                            f"checkpoint is damaged or altered: use another one")
        path = os.path.join(folder, rel)
        if rel not in sizes:
            try:
                sizes[rel] = os.path.getsize(path)
            except OSError:
                raise UserError(f"{path} is missing (its folder's .metadata names it); the checkpoint is incomplete: "
                                f"use another one") from None
        end = info.offset + info.length
        if sizes[rel] < end:
            raise UserError(f"{path} holds {sizes[rel]} bytes but its folder's .metadata needs {end}; the checkpoint "
                            f"is truncated: use another one")
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:
            raise UserError(f"{path}: the object {index.fqn} is stored through {list(info.transform_descriptors)}, "
                            f"which mimo-sft never writes; the checkpoint was altered: use another one")
        with open(path, "rb") as fh:
            fh.seek(info.offset)
            blob = fh.read(info.length)
        load_weights_only(io.BytesIO(blob), f"{path} ({index.fqn})", "a checkpoint's stored object")
        checked += 1
    return checked


_CHECKED: dict = {}


def _fingerprint(folder: str) -> tuple:
    entries = []
    with os.scandir(folder) as it:
        for e in it:
            if e.is_file():
                st = e.stat()
                entries.append((e.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(entries))


def trusted_part(folder: str):
    """The checked ``Metadata`` of the dist-checkpoint part ``folder`` (``model/`` or ``optimizer/``);
    call it before megatron or torch reads the folder. Checked once per process while the folder's
    files are unchanged (a resume checks both parts up front and reads them after; the streamed export
    reads a part many times)."""
    if not os.path.isdir(folder):
        raise UserError(f"{folder} is missing; the checkpoint is incomplete: use another one")
    key = (os.path.realpath(folder), _fingerprint(folder))
    if key not in _CHECKED:
        metadata = read_metadata(folder)
        _check_part(folder, metadata)
        if len(_CHECKED) >= 8:  # a process reads a checkpoint or two: keep the last few parts
            _CHECKED.clear()
        _CHECKED[key] = metadata
    return _CHECKED[key]


def stored_tensor_keys(folder: str) -> set[str]:
    """The keys of the tensors the part ``folder`` stores (what megatron's ``load_tensors_metadata``
    lists), from the checked metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k for k, v in trusted_part(folder).state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def trusted_reader(folder: str):
    """A torch DCP ``FileSystemReader`` for ``folder`` whose metadata is :func:`trusted_part`'s."""
    from torch.distributed.checkpoint import FileSystemReader

    class TrustedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = trusted_part(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return TrustedReader(folder)


def _old_rank_file_globals() -> list:
    """What a rank file written before JSON-safe RNG state held beyond torch's weights-only set:
    numpy's RNG key as an array (its reconstruct function, ndarray, dtype and the uint32 dtype class)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rank_file(path: str) -> dict:
    """A rank file's contents (``{"rng": ..., "step": ..., ...}``), weights-only."""
    state = load_weights_only(path, path, "a rank's RNG state file", allow=_old_rank_file_globals())
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        raise UserError(f"{path}: does not hold a rank's RNG state; the checkpoint is damaged: use another one")
    return state


def verify_checkpoint(ckpt: str, *, rank_files: str | None = "all") -> dict:
    """Check a checkpoint folder without loading a tensor: each part's metadata and byte items, the sizes
    of the files they name, and the rank files (``rank_files``: ``"all"``, one file's name, or None).
    Returns what was checked, counted."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    counts = {"parts": 0, "data_files": 0, "objects": 0, "rank_files": 0}
    for part in PARTS:
        folder = os.path.join(ckpt, part)
        if not os.path.isdir(folder):
            continue
        metadata = trusted_part(folder)
        counts["parts"] += 1
        counts["data_files"] += len({i.relative_path for i in metadata.storage_data.values()})
        counts["objects"] += sum(isinstance(v, BytesStorageMetadata) for v in metadata.state_dict_metadata.values())
    names = sorted(n for n in os.listdir(ckpt) if n.startswith("rank_") and n.endswith(".pt"))
    for name in names if rank_files == "all" else [n for n in names if n == rank_files]:
        load_rank_file(os.path.join(ckpt, name))
        counts["rank_files"] += 1
    return counts
