"""Load an SFT dataset through ``datasets`` (or its shards in place: ``data.streamed``) as an ``SFTSource``.

The rows' canonical form and its rules live in ``data.rows``; this module opens files, folders,
``save_to_disk`` folders and hub names, and picks the columns and image folder a dataset needs.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

from mimo_sft.data.load_errors import load_failure, object_top_level
from mimo_sft.config.mixture import is_streamed
from mimo_sft.data.rows import VIDEO_COLUMNS, SFTSource, checked, pick_columns, source_folders
from mimo_sft.data.streamed import load_streamed_source
from mimo_sft.errors import BadSampleError, UserError


# --------------------------------------------------------------------------- loading

def _is_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


#: the file types a loaded source may be, and the ``datasets`` builder of each
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}


def loaded_kind(dataset_path: str | None, split: str = "train") -> tuple[str, Path]:
    """How start-up opens ``dataset_path`` through ``datasets``: ``("file", path)``, ``("disk", folder)`` (a
    ``save_to_disk`` folder), ``("folder", folder)`` or ``("hub", path)``, after the refusals it makes before
    reading anything (no path, a file type it cannot read, a split of a single file, a path that does not
    exist, a hub name while the hub is offline). ``validate`` calls it too (``data.source_probe``)."""
    if not dataset_path:
        raise UserError("data.dataset_path is not set; pass --dataset-path (a parquet/json/jsonl file or folder)")
    path = Path(dataset_path).expanduser()
    if path.is_file():
        ext = path.suffix.lower()
        if ext not in BUILDERS:
            raise UserError(f"--dataset-path {path}: unsupported file type '{ext}'; use .parquet, .json or .jsonl")
        if split != "train":
            raise UserError(f"--dataset-split {split}: {path} is a single file, which is one split ('train'); "
                            f"point --dataset-path at the {split} file instead")
        return "file", path
    if path.is_dir():
        on_disk = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        return ("disk" if on_disk else "folder"), path
    if path.is_absolute() or dataset_path.startswith((".", "~")) or dataset_path.count("/") > 1:
        raise UserError(f"--dataset-path {dataset_path} does not exist; point it at a dataset file or folder")
    if _is_offline():
        raise UserError(f"--dataset-path '{dataset_path}' is not a local file or folder and the hub is offline "
                        "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); download it and pass its local path")
    return "hub", path


def load_raw_dataset(dataset_path: str | None, split: str = "train"):
    """A ``datasets.Dataset`` from a file, a folder, a ``save_to_disk`` folder, or a hub name."""
    import datasets

    kind, path = loaded_kind(dataset_path, split)
    # datasets logs its own error line before raising; ours (below) is the one the user should see
    ds_logger = logging.getLogger("datasets")
    level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)
    try:
        if kind == "file":
            ds = datasets.load_dataset(BUILDERS[path.suffix.lower()], data_files={split: str(path)}, split=split)
            nested = object_top_level(ds, path)
            if nested:
                raise UserError(nested)
        elif kind == "disk":
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"--dataset-split '{split}' not in {path} (splits: {', '.join(ds)}); pick one of those")
                ds = ds[split]
        elif kind == "folder":
            ds = datasets.load_dataset(str(path), split=split)
        else:
            ds = datasets.load_dataset(dataset_path, split=split)
    except UserError:
        raise
    except ValueError as err:
        msg = _first_line(err)
        if "split" in msg.lower():
            raise UserError(f"--dataset-split '{split}' not found in {dataset_path} ({msg})") from None
        raise UserError(f"--dataset-path {dataset_path}: cannot load ({load_failure(path, err)})") from None
    except Exception as err:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ArrowInvalid)
        raise UserError(f"--dataset-path {dataset_path}: cannot load ({load_failure(path, err)})") from None
    finally:
        ds_logger.setLevel(level)
    return ds


def load_sft_dataset(data_cfg, *, check_files: bool = True) -> SFTSource:
    """Load ``data_cfg.dataset_path`` and pick the schema, columns and image folder it needs.

    ``check_files=False``: skip the image-file check (training runs it once on one rank and hands
    the verdict to the others, ``train.feed``; see ``data.file_check``; ``check-data`` lists every
    missing file itself). Several sources (``data.datasets``, ``--dataset-path`` repeated): a
    ``data.mixture.MixtureSource`` of them, each loaded by this function with its own settings."""
    if getattr(data_cfg, "datasets", None):
        from mimo_sft.config.mixture import mixture_specs
        from mimo_sft.data.mixture import load_mixture

        return load_mixture(mixture_specs(data_cfg), lambda one: load_sft_dataset(one, check_files=check_files))
    if is_streamed(data_cfg):  # shards read in place, no Arrow copy (data.shards)
        return load_streamed_source(data_cfg, check_files=check_files)
    ds = load_raw_dataset(data_cfg.dataset_path, data_cfg.split)
    cols = list(ds.column_names)
    schema, text_column, images_column = pick_columns(data_cfg, cols)
    if len(ds) == 0:
        raise UserError(f"--dataset-path {data_cfg.dataset_path} (split '{data_cfg.split}') has no samples")
    # ShareGPT's clip column (LLaVA-Video's "video"/"videos") is kept too: SFTSource reads a row's clips from it
    videos = next((c for c in VIDEO_COLUMNS if c in cols), None) if schema == "sharegpt" else None
    keep = [text_column] + ([images_column] if images_column else []) + ([videos] if videos else [])
    # The images column is read in Arrow format: stored values as they are (bytes/path dicts), so
    # nothing is decoded, and unlike cast_column(Image(decode=False)) no copy of the dataset is
    # written. The text column uses the normal format (datasets may store parts as Json features).
    ds = ds.select_columns(keep)
    base_dir, image_root = source_folders(data_cfg)
    source = SFTSource(ds, schema=schema, text_column=text_column, images_column=images_column,
                       base_dir=base_dir, image_root=image_root, dataset_path=str(data_cfg.dataset_path))
    return checked(source, check_files=check_files)


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
        raise BadSampleError(idx, str(ref), "image file not found; check the path or set --image-root") from None
    except (UnidentifiedImageError, OSError) as err:
        where = None if isinstance(ref, bytes) else str(ref)
        what = "in-dataset image bytes" if isinstance(ref, bytes) else "image file"
        reason = "not a recognised image format" if isinstance(err, UnidentifiedImageError) else _first_line(err)
        raise BadSampleError(idx, where, f"cannot read {what} ({reason}); fix or remove the image") from None
