"""Load an SFT dataset through ``datasets`` and adapt its rows to one canonical sample form.

Why one form: preprocessing should not care whether a row came from a ``messages`` dataset or a
ShareGPT/LLaVA one. ``SFTSource[i]`` returns ``(messages, image_refs)`` where ``messages`` holds only
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts and ``image_refs`` are undecoded
references (bytes, a resolved path, or an in-memory PIL image). Images are never decoded here:
image columns are cast to ``decode=False`` so the metadata-only path can read just the header.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any

from mimo_sft.errors import UserError

_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
             "bot": "assistant", "system": "system"}
IMAGE_MARKER = "<image>"


# --------------------------------------------------------------------------- loading

def _is_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_raw_dataset(dataset_path: str | None, split: str = "train"):
    """A ``datasets.Dataset`` from a file, a folder, a ``save_to_disk`` folder, or a hub name."""
    import datasets

    if not dataset_path:
        raise UserError("data.dataset_path is not set; pass --dataset-path (a parquet/json/jsonl file or folder)")
    path = Path(dataset_path).expanduser()
    # datasets logs its own error line before raising; ours (below) is the one the user should see
    ds_logger = logging.getLogger("datasets")
    level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)
    try:
        if path.is_file():
            ext = path.suffix.lower()
            builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}.get(ext)
            if builder is None:
                raise UserError(f"--dataset-path {path}: unsupported file type '{ext}'; use .parquet, .json or .jsonl")
            if split != "train":
                raise UserError(f"--dataset-split {split}: {path} is a single file, which is one split ('train'); "
                                f"point --dataset-path at the {split} file instead")
            ds = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        elif path.is_dir():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise UserError(f"--dataset-split '{split}' not in {path} (splits: {', '.join(ds)}); pick one of those")
                    ds = ds[split]
            else:
                ds = datasets.load_dataset(str(path), split=split)
        elif path.is_absolute() or dataset_path.startswith((".", "~")) or dataset_path.count("/") > 1:
            raise UserError(f"--dataset-path {dataset_path} does not exist; point it at a dataset file or folder")
        else:
            if _is_offline():
                raise UserError(f"--dataset-path '{dataset_path}' is not a local file or folder and the hub is offline "
                                "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); download it and pass its local path")
            ds = datasets.load_dataset(dataset_path, split=split)
    except UserError:
        raise
    except ValueError as err:
        msg = _first_line(err)
        if "split" in msg.lower():
            raise UserError(f"--dataset-split '{split}' not found in {dataset_path} ({msg})") from None
        raise UserError(f"--dataset-path {dataset_path}: cannot load ({msg})") from None
    except Exception as err:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ArrowInvalid)
        raise UserError(f"--dataset-path {dataset_path}: cannot load ({type(err).__name__}: {_first_line(err)})") from None
    finally:
        ds_logger.setLevel(level)
    return ds


# --------------------------------------------------------------------------- the canonical source

class SFTSource:
    """Rows of a dataset as ``(messages, image_refs)``; picklable for DataLoader workers."""

    def __init__(self, ds, *, schema: str, text_column: str, images_column: str | None, base_dir: Path | None,
                 image_root: Path | None, dataset_path: str):
        self.ds = ds
        self.schema = schema
        self.text_column = text_column
        self.images_column = images_column
        self.base_dir = base_dir
        self.image_root = image_root
        self.dataset_path = dataset_path
        self._text = ds.select_columns([text_column])
        self._images = ds.select_columns([images_column]).with_format("arrow") if images_column else None

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, idx: int) -> tuple[list[dict], list[Any]]:
        text = self._text[int(idx)][self.text_column]
        if self.schema == "messages":
            messages = _canonical_messages(text, idx, self.text_column)
        else:
            messages = _sharegpt_messages(text, idx, self.text_column)
        refs = []
        if self.images_column is not None:
            raw = self._images[int(idx)].column(0).to_pylist()[0]
            if raw is None:
                raw = []
            elif not isinstance(raw, (list, tuple)):
                raw = [raw]
            refs = [self._resolve(r, idx) for r in raw if r is not None]
        n_parts = sum(1 for m in messages for p in m["content"] if p["type"] == "image")
        if n_parts != len(refs):
            if self.images_column is None:
                raise UserError(f"sample {idx} of {self.dataset_path}: {n_parts} image placeholder(s) in the text but the "
                                f"dataset has no images column; name it with --images-column")
            raise UserError(f"sample {idx} of {self.dataset_path}: {n_parts} image placeholder(s) in the text but "
                            f"{len(refs)} image(s) in column '{self.images_column}'; fix the row or point "
                            f"--images-column at the images")
        return messages, refs

    def image_paths(self) -> list[tuple[int, str]]:
        """(row, path) of every image stored as a file path, read from Arrow without decoding.

        Only path references are listed (in-dataset bytes need no file); used to find missing
        files before step 0 instead of hours into a run.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        if self.images_column is None:
            return []
        column = self.ds.data.table.column(self.images_column).combine_chunks()
        rows = pa.array(range(len(column)), pa.int64())
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            rows = pc.list_parent_indices(column)
            column = pc.list_flatten(column)
        if pa.types.is_struct(column.type):
            names = [column.type.field(i).name for i in range(column.type.num_fields)]
            if "path" not in names:
                return []
            paths = pc.struct_field(column, "path")
            keep = pc.is_valid(paths)
            if "bytes" in names:
                keep = pc.and_(keep, pc.is_null(pc.struct_field(column, "bytes")))
        elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            paths = column
            keep = pc.is_valid(paths)
        else:
            return []
        rows, paths = pc.filter(rows, keep).to_pylist(), pc.filter(paths, keep).to_pylist()
        return [(r, p) for r, p in zip(rows, paths) if not str(p).startswith("{")]

    def check_image_files(self) -> None:
        missing = []
        for row, ref in self.image_paths():
            path = self._resolve(ref, row)
            if isinstance(path, Path) and not path.is_file():
                missing.append((row, path))
        if missing:
            row, path = missing[0]
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise UserError(f"sample {row}: image file {path} not found{more}; check the paths or set --image-root")

    def _resolve(self, ref, idx):
        """bytes -> ``bytes``; path -> absolute ``Path``; PIL image -> itself."""
        if isinstance(ref, dict):
            if ref.get("bytes"):
                return bytes(ref["bytes"])
            ref = ref.get("path")
            if not ref:
                raise UserError(f"sample {idx} of {self.dataset_path}: image entry has neither bytes nor path; fix the '{self.images_column}' column")
        if isinstance(ref, (bytes, bytearray)):
            return bytes(ref)
        if isinstance(ref, str) and ref.startswith("{"):  # a Json-typed column holds dicts as text
            try:
                return self._resolve(json.loads(ref), idx)
            except ValueError:
                pass
        if isinstance(ref, (str, os.PathLike)):
            p = Path(ref).expanduser()
            if not p.is_absolute():
                root = self.image_root or self.base_dir or Path.cwd()
                p = root / p
            return p
        if hasattr(ref, "size") and hasattr(ref, "mode"):  # PIL image held in memory
            return ref
        raise UserError(f"sample {idx} of {self.dataset_path}: unsupported image value of type {type(ref).__name__} "
                        f"in column '{self.images_column}'; use paths, bytes or images")


def _clean_part(part, idx, col) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise UserError(f"sample {idx}: content parts in column '{col}' must be dicts with 'type'; got {type(part).__name__}")
    kind = part.get("type")
    if kind == "image" or (kind is None and part.get("image") is not None):
        return {"type": "image"}
    if kind == "text" or (kind is None and part.get("text") is not None):
        return {"type": "text", "text": part.get("text") or ""}
    raise UserError(f"sample {idx}: content part type '{kind}' in column '{col}' is not supported; use 'text' or 'image'")


def _canonical_messages(messages, idx, col) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError(f"sample {idx}: column '{col}' must hold a non-empty list of messages")
    out = []
    for m in messages:
        role = _ROLE_MAP.get(str(m.get("role", "")).lower()) if isinstance(m, dict) else None
        if role is None:
            raise UserError(f"sample {idx}: every message in '{col}' needs a role of system/user/assistant")
        content = m.get("content")
        parts = [_clean_part(content, idx, col)] if isinstance(content, str) else [_clean_part(p, idx, col) for p in (content or [])]
        out.append({"role": role, "content": parts})
    return out


def _split_markers(text: str) -> list[dict]:
    parts = []
    pieces = text.split(IMAGE_MARKER)
    for i, piece in enumerate(pieces):
        if i > 0:
            parts.append({"type": "image"})
        piece = piece.strip("\n") if len(pieces) > 1 else piece
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _sharegpt_messages(turns, idx, col) -> list[dict]:
    if not isinstance(turns, (list, tuple)) or not turns:
        raise UserError(f"sample {idx}: column '{col}' must hold a non-empty list of turns with 'from'/'value'")
    out = []
    for t in turns:
        if not isinstance(t, dict) or "value" not in t:
            raise UserError(f"sample {idx}: every turn in '{col}' needs 'from' and 'value' (ShareGPT/LLaVA schema)")
        role = _ROLE_MAP.get(str(t.get("from", t.get("role", ""))).lower())
        if role is None:
            raise UserError(f"sample {idx}: turn speaker '{t.get('from')}' in '{col}' is not human/gpt/system")
        out.append({"role": role, "content": _split_markers(str(t["value"] or ""))})
    return out


def load_sft_dataset(data_cfg) -> SFTSource:
    """Load ``data_cfg.dataset_path`` and pick the schema, columns and image folder it needs."""
    ds = load_raw_dataset(data_cfg.dataset_path, data_cfg.split)
    cols = list(ds.column_names)
    schema = data_cfg.schema
    if schema == "auto":
        if data_cfg.messages_column in cols:
            schema = "messages"
        elif data_cfg.conversations_column in cols:
            schema = "sharegpt"
        else:
            raise UserError(f"--dataset-path {data_cfg.dataset_path}: no '{data_cfg.messages_column}' or "
                            f"'{data_cfg.conversations_column}' column (columns: {', '.join(cols)}); "
                            "set --messages-column or --conversations-column")
    text_column = data_cfg.messages_column if schema == "messages" else data_cfg.conversations_column
    flag = "--messages-column" if schema == "messages" else "--conversations-column"
    if text_column not in cols:
        raise UserError(f"--dataset-path {data_cfg.dataset_path}: column '{text_column}' not found "
                        f"(columns: {', '.join(cols)}); set {flag}")
    images_column = data_cfg.images_column if data_cfg.images_column in cols else None
    if images_column is None and schema == "sharegpt" and "image" in cols:
        images_column = "image"  # LLaVA's single-image column
    if images_column is None and data_cfg.images_column != "images":
        raise UserError(f"--images-column '{data_cfg.images_column}' not found (columns: {', '.join(cols)}); fix --images-column")
    if len(ds) == 0:
        raise UserError(f"--dataset-path {data_cfg.dataset_path} (split '{data_cfg.split}') has no samples")
    keep = [text_column] + ([images_column] if images_column else [])
    # The images column is read in Arrow format: stored values as they are (bytes/path dicts), so
    # nothing is decoded, and unlike cast_column(Image(decode=False)) no copy of the dataset is
    # written. The text column uses the normal format (datasets may store parts as Json features).
    ds = ds.select_columns(keep)
    p = Path(str(data_cfg.dataset_path)).expanduser()
    base_dir = (p if p.is_dir() else p.parent).resolve() if p.exists() else None
    image_root = Path(data_cfg.image_root).expanduser().resolve() if data_cfg.image_root else None
    if image_root is not None and not image_root.is_dir():
        raise UserError(f"--image-root {data_cfg.image_root} is not a folder; point it at the folder the image paths are relative to")
    source = SFTSource(ds, schema=schema, text_column=text_column, images_column=images_column,
                       base_dir=base_dir, image_root=image_root, dataset_path=str(data_cfg.dataset_path))
    try:
        source.check_image_files()
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - an Arrow layout we do not know: images are still checked when read
        pass
    if images_column is None:
        # Fail now, not mid-training, if the text asks for images the dataset does not have.
        for i in range(min(len(source), 64)):
            source[i]
    return source


def open_image_header(ref, idx: int):
    """A lazily-opened PIL image (header parsed, pixels not decoded) with clear errors."""
    from PIL import Image, UnidentifiedImageError

    if hasattr(ref, "size") and hasattr(ref, "mode"):
        return ref
    try:
        if isinstance(ref, bytes):
            return Image.open(io.BytesIO(ref))
        return Image.open(ref)
    except FileNotFoundError:
        raise UserError(f"sample {idx}: image file {ref} not found; check the path or set --image-root") from None
    except (UnidentifiedImageError, OSError) as err:
        where = "in-dataset image bytes" if isinstance(ref, bytes) else f"image file {ref}"
        reason = "not a recognised image format" if isinstance(err, UnidentifiedImageError) else _first_line(err)
        raise UserError(f"sample {idx}: cannot read {where} ({reason}); fix or remove the image") from None
