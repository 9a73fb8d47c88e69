"""Per-row reordering counts written once by ``check-data --write-costs``: index mode then plans a
micro-batch without reading any of its rows.

Why: index-mode reordering (``data.indexed``) needs every sample's cost -- its real tokens and its
image tokens -- before anyone reads the sample. Without this file each rank runs the text path of its
canonical share (the row's text, its image headers, the tokenizer), which for a streamed source
means reading the row groups its share falls in, image bytes included, once for the costs and once
more by the owner. ``check-data`` already runs that text path on every row, so it can keep the two
counts per row (8 bytes) and write them: with the file, a rank's cost work per micro-batch is an
array lookup.

Exactness: a cost is :func:`reorder.cost_model.weighted_costs` of ``(image tokens * merge^2, real
tokens)``, the counts ``batch_costs`` reads from ``input_ids`` and ``attention_mask``; the file holds
those same counts of the same encode, so plans and losses equal the computed ones bit for bit
(tests/test_cost_file.py). A row whose image tokens pass ``--seq-length`` is marked :data:`DROPPED`
and replaced by the next row of its source, as ``MicroBatchDataset.encode`` does; a row that could
not be encoded (a bad image, a broken message) is :data:`UNKNOWN` and computed at run time.

Staleness: the file is named by a key over what the counts depend on -- the rows (datasets'
fingerprint, or the shards' paths, sizes and modification times), the columns and image folder, the
checkpoint's tokenizer, chat template and processor files, ``--seq-length`` and the pixel bounds --
so a changed input finds no file and the costs are computed as before, never read stale. Each file has a
``.json`` beside it saying which rows and settings it was made for, so a run whose settings differ (another
``--seq-length``, say) says in its banner which file it did not use and why (:func:`other_settings`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

#: bump when the text path's counts change for the same inputs
COST_FORMAT = 1
DROPPED, UNKNOWN = -1, -2
#: the checkpoint files that decide how a row is tokenised and how many image tokens it gets
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
               "special_tokens_map.json", "added_tokens.json", "chat_template.json", "chat_template.jinja",
               "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def cost_dir(data_cfg) -> Path:
    """``--cost-dir``, else ``cost_files`` in datasets' cache folder."""
    if getattr(data_cfg, "cost_dir", None):
        return Path(data_cfg.cost_dir).expanduser()
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "mimo_sft_costs"


def cost_key(source, pre) -> str:
    """What names one source's counts (module docstring): its rows (:func:`rows_key`) and the run's settings."""
    h = hashlib.sha256(rows_key(source, pre).encode())
    for value in settings_of(pre).values():
        h.update(f"{value}\0".encode())
    return h.hexdigest()[:32]


def rows_key(source, pre) -> str:
    """What names one source's rows as the text path reads them, whatever the run's settings: the rows, the
    columns and image folder, the checkpoint's tokenizer, template and processor files."""
    h = hashlib.sha256()
    for part in (COST_FORMAT, source.content_key(), source.image_root, source.base_dir, len(source), source.schema,
                 source.text_column, source.images_column):
        h.update(f"{part}\0".encode())
    for name in MODEL_FILES:
        f = Path(pre.model_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:32]


#: the run's settings a row's counts depend on, as the flags that set them
SETTING_FLAGS = {"seq_length": "--seq-length", "min_pixels": "--min-pixels", "max_pixels": "--max-pixels",
                 "max_image_pixels": "--max-image-pixels", "video_settings": "--video-* (fps, frames, pixels)"}


def settings_of(pre) -> dict:
    return {key: getattr(pre, key) for key in SETTING_FLAGS}


@dataclass
class CostTable:
    """One source's counts per row (int32 columns of one ``[rows, 2]`` ``.npy``; :data:`DROPPED` /
    :data:`UNKNOWN` where no count)."""

    tokens: np.ndarray
    image_tokens: np.ndarray
    path: str

    def counts(self, row: int, rows: int) -> Optional[tuple[int, int]]:
        """``(real tokens, image tokens)`` of the sample that row ``row`` gives (a dropped row: the
        next row of the source that fits); None where it must be computed."""
        for _ in range(rows):
            t = int(self.tokens[row])
            if t == UNKNOWN:
                return None
            if t != DROPPED:
                return t, int(self.image_tokens[row])
            row = (row + 1) % rows
        return None  # no row fits: the encode path raises the user error


def parts_of(source) -> list:
    """A mixture's sources, or the one source."""
    return list(getattr(source, "parts", None) or [source])


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npy")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def grids_path(path: Path) -> Path:
    """Beside a cost file: its rows' image grids (``[images, 4]`` int32: row, t, h, w in patches), what the
    memory forecast bounds each micro-batch's attention padding with (``memory.from_data``)."""
    return path.with_name(f"{path.stem}.grids.npy")


def write_cost_files(source, pre, tokens: np.ndarray, image_tokens: np.ndarray, folder: Path,
                     grids: Optional[np.ndarray] = None) -> list[str]:
    """The counts of ``source``'s rows (a mixture: in its global index order), one file per source,
    each written atomically, with its rows' image grids beside it (``grids``: ``[images, 4]`` global row,
    t, h, w); returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    grids = np.zeros((0, 4), dtype=np.int32) if grids is None else np.asarray(grids, dtype=np.int32).reshape(-1, 4)
    grids = grids[np.argsort(grids[:, 0], kind="stable")]
    paths, start = [], 0
    for part in parts_of(source):
        n = len(part)
        path = folder / f"{cost_key(part, pre)}.npy"
        mine = grids[(grids[:, 0] >= start) & (grids[:, 0] < start + n)].copy()
        mine[:, 0] -= start
        _save_atomic(grids_path(path), mine)  # first: a cost file is never there without its grids
        # beside it, what it was made for: a run with other settings is told why it is not used
        about = path.with_suffix(".json")
        about.write_text(json.dumps({"rows_key": rows_key(part, pre), "source": str(part.dataset_path),
                                     **settings_of(pre)}))
        _save_atomic(path, np.stack([tokens[start:start + n], image_tokens[start:start + n]], axis=1).astype(np.int32))
        paths.append(str(path))
        start += n
    return paths


def other_settings(part, pre, folder: Path) -> Optional[str]:
    """Why a source has no cost file for this run while it has one for other settings (one line), else None."""
    mine, now = rows_key(part, pre), settings_of(pre)
    for about in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            made = json.loads(about.read_text())
        except (OSError, ValueError):
            continue
        differ = [f"{SETTING_FLAGS[k]} {made.get(k)} (this run: {v})" for k, v in now.items() if made.get(k) != v]
        if made.get("rows_key") == mine and differ:
            return (f"the cost file of {part.dataset_path} ({about.with_suffix('.npy')}) was written for "
                    f"{', '.join(differ)}: its costs are computed from the rows instead; run `mimo-sft check-data "
                    f"--write-costs` with this run's flags to write one for them")
    return None


def load_cost_tables(source, pre, folder: Path) -> list[Optional[CostTable]]:
    """Each source's table where a file with its key exists (None: computed at run time)."""
    out: list[Optional[CostTable]] = []
    for part in parts_of(source):
        path = folder / f"{cost_key(part, pre)}.npy"
        table = None
        if path.is_file():
            try:  # memory-mapped: the node's ranks and workers share one copy in the page cache
                both = np.load(path, mmap_mode="r")
                if both.shape == (len(part), 2):
                    table = CostTable(both[:, 0], both[:, 1], str(path))
            except (OSError, ValueError):
                table = None  # unreadable: computed instead
        out.append(table)
    return out


class SourceCounts:
    """Global index of ``source`` -> the table's counts (a mixture's index names a source and a row)."""

    def __init__(self, source, tables: list[Optional[CostTable]]):
        self.source, self.tables = source, tables
        self.mixture = getattr(source, "parts", None) is not None
        self.sizes = [len(p) for p in parts_of(source)]

    def __bool__(self) -> bool:
        return any(t is not None for t in self.tables)

    def counts(self, idx: int) -> Optional[tuple[int, int]]:
        s, row = self.source.locate(idx) if self.mixture else (0, int(idx))
        table = self.tables[s]
        return None if table is None else table.counts(row, self.sizes[s])


# ---- the memory forecast's per-row counts (check 23) ---------------------------------------------------
def any_written(data_cfg) -> bool:
    """Whether ``--cost-dir`` holds any cost file: asked before anything costly (the dataset, the tokenizer), so
    that a run where check-data never wrote one pays nothing for looking."""
    folder = cost_dir(data_cfg)
    return folder.is_dir() and any(folder.glob("*.json"))


def _source_rows(table: CostTable, grids: np.ndarray):
    """One source's table as ``memory.from_data.SourceRows``: its rows that train, each standing for itself and
    the dropped rows before it that it replaces (the next row that fits, cyclically, as ``CostTable.counts``)."""
    from mimo_sft.memory.from_data import SourceRows

    tokens = np.asarray(table.tokens)
    kept = np.flatnonzero(tokens != DROPPED)
    stands = np.ones(len(kept), dtype=np.int64)
    dropped = np.flatnonzero(tokens == DROPPED)
    if len(dropped) and len(kept):
        np.add.at(stands, np.searchsorted(kept, dropped) % len(kept), 1)
    position = np.full(len(tokens), -1, dtype=np.int64)
    position[kept] = np.arange(len(kept))
    rows = position[grids[:, 0]] if len(grids) else np.zeros(0, dtype=np.int64)
    mine = rows >= 0
    return SourceRows(tokens=tokens[kept], image_tokens=np.asarray(table.image_tokens)[kept], stands_for=stands,
                      image_rows=rows[mine], grids=grids[mine, 1:])


def load_row_counts(source, pre, folder: Path):
    """``(memory.from_data.RowCounts, None)`` from every source's cost file in ``folder`` (``check-data
    --write-costs`` with this run's settings), or ``(None, why not)``. No row, image header or pixel is read:
    ``source`` and ``pre`` only name the files (their key)."""
    from mimo_sft.memory.from_data import RowCounts

    sources, files, unknown = [], [], 0
    for part, table in zip(parts_of(source), load_cost_tables(source, pre, folder)):
        if table is None:
            return None, other_settings(part, pre, folder) or (
                f"{part.dataset_path} has no cost file for this run's settings")
        try:
            grids = np.load(grids_path(Path(table.path)), mmap_mode="r").reshape(-1, 4)
        except (OSError, ValueError):
            return None, (f"the cost file {table.path} has no image grids beside it (written by an older "
                          f"mimo-sft): run `mimo-sft check-data --write-costs` again")
        unknown += int(np.sum(np.asarray(table.tokens) == UNKNOWN))
        sources.append(_source_rows(table, np.asarray(grids)))
        files.append(table.path)
    counts = RowCounts(sources, mixture=getattr(source, "parts", None) is not None, unknown=unknown, files=files)
    return (counts, None) if counts.rows else (None, "no row of the data fits in --seq-length")
