"""Shards read in place: parquet files and WebDataset tars as numbered rows, with no copy of the dataset.

Why not ``datasets.load_dataset``: it converts every shard into Arrow files in its cache, a second copy
of the dataset on local disk (image bytes included), before step 0. Why not ``datasets``' streaming
mode or the ``webdataset`` pipeline either: both serve one stream per process, and
``split_dataset_by_node`` hands shards to ranks by world size, so the global sample order would
depend on the DP size (a relayout resume needs it not to: ``data.sampler``), and a resume replays the
stream up to its position (``skip(n)`` reads ``n`` rows: minutes at 10M rows).

Both formats carry what row access needs without reading the data: a parquet footer lists each row
group's row count, and a tar's member headers give each member's offset and size. So row ``n`` is
(shard, row group, row) or (shard, member offsets), found from metadata alone, and a source of shards
is indexable like a ``datasets.Dataset``: the canonical sampler, the mixture's interleave, index-mode
reordering and the resume from ``consumed_samples`` work unchanged, in the same global order for every
DP size. What is read:

* **tar**: a sample's members, each one ``pread`` of its own bytes. Only plain ``.tar`` shards can be
  read in place (a compressed tar has no member offsets; it is refused). The index (two integer
  arrays per shard, from the headers only: 24 bytes a sample, 16 an image) is cached in ``datasets``'
  cache folder, keyed by the shard's path, size and modification time, and memory-mapped from there,
  so the node's other ranks and a resumed run read it instead of the headers and share one copy.
* **parquet**: a row is read with its row group (parquet's unit of reading), only the columns the
  source uses; a process keeps its last :data:`CACHED_GROUPS` row groups, so the consecutive rows of
  a rank's share of a micro-batch cost one read. Every data rank reads the row groups its own samples
  fall in, and only those: on one node the page cache holds a group once for all its ranks; across
  nodes each node reads it (docs/data.md: keep image row groups to a few hundred rows).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tarfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from mimo_sft.errors import UserError

#: row groups a process keeps decoded (per parquet source)
CACHED_GROUPS = 2
#: image members of a WebDataset sample, by their last suffix
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
#: clip members of a WebDataset sample (a sample's ``<key>.mp4``: its video parts' clips, in field order)
VIDEO_EXTS = (".mp4", ".webm", ".mkv", ".mov", ".avi")
#: the tar index's layout version (part of its cache key): media rows are (offset, size, kind: 0 image, 1 clip)
TAR_INDEX_VERSION = 2
_KINDS = {".parquet": "parquet", ".tar": "webdataset"}
_COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def _kind_of(path: Path) -> Optional[str]:
    name = path.name.lower()
    if name.endswith(_COMPRESSED):
        raise UserError(f"--dataset-path: shard {path} is a compressed tar; a streamed source is read in place, "
                        "member by member, which needs plain .tar shards: decompress them")
    return _KINDS.get(path.suffix.lower())


def _candidates(path_text: str, *, split: str) -> list[Path]:
    p = Path(path_text).expanduser()
    if any(ch in path_text for ch in "*?["):
        return sorted(Path(x) for x in glob.glob(str(p)) if Path(x).is_file())
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise UserError(f"--dataset-path {path_text} does not exist; point it at a shard, a folder of shards or a glob")
    return split_files(p, split, path_text)


def split_files(folder: Path, split: str, path_text: str) -> list[Path]:
    """The files of ``split`` in ``folder``, chosen by ``datasets``' own rules for a folder (what
    ``load_dataset(folder, split=...)`` reads when the folder is loaded instead): the split-name keywords and
    their aliases in file and folder names (``train-*``, ``*-valid-*``, ``validation/``, ``dev``, ``test``...,
    the ``data/{split}-NNNNN-of-NNNNN`` shards), and every file for ``train`` where no name says a split.
    Calling datasets' resolver, not a copy of its rules, keeps streamed and loaded sources on the same files."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    from datasets.exceptions import DataFilesNotFoundError

    base = folder.expanduser().resolve().as_posix()
    try:
        by_split = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
    except (FileNotFoundError, DataFilesNotFoundError):
        by_split = {}
    if not by_split:
        raise UserError(f"--dataset-path {path_text}: no .parquet or .tar shards found; point it at the shards")
    if split not in by_split:
        raise UserError(f"--dataset-split '{split}': {path_text} has the split(s) {', '.join(map(str, by_split))} "
                        f"(named as datasets names a folder's files); pick one of those")
    return sorted(Path(f) for f in by_split[split])


def find_shards(path_text: str, *, split: str = "train") -> tuple[str, list[Path]]:
    """``(kind, shard files in name order)`` of a shard file, a folder of shards or a glob."""
    files = _candidates(path_text, split=split)
    by_kind: dict[str, list[Path]] = {}
    for f in files:
        kind = _kind_of(f)
        if kind is not None:
            by_kind.setdefault(kind, []).append(f)
        elif len(files) == 1:
            raise UserError(f"--dataset-path {f}: a streamed source is .parquet or WebDataset .tar shards, not "
                            f"'{f.suffix}'; drop --streaming to load it through datasets (in a mixture, set "
                            f"'streaming: true' only on the sources that are shards, in YAML data.datasets)")
    if not by_kind:
        raise UserError(f"--dataset-path {path_text}: no .parquet or .tar shards found; point it at the shards")
    if len(by_kind) > 1:
        raise UserError(f"--dataset-path {path_text} holds both parquet and tar shards; give each kind as a source "
                        "of its own (repeat --dataset-path)")
    kind, found = by_kind.popitem()
    return kind, found


def files_key(files: list[str]) -> str:
    """What names a set of shards' contents: paths, sizes and modification times."""
    parts = []
    for f in files:
        st = os.stat(f)
        parts.append(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


class _Rows:
    """Rows numbered over the shards in order: ``starts[s]`` is shard ``s``'s first row."""

    kind = ""

    def __init__(self, files: list[Path], rows: list[int]):
        self.files = [str(f) for f in files]
        self.rows = [int(n) for n in rows]
        self.starts = np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard, row in the shard)`` of row ``i``."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} outside the {len(self)} rows of {len(self.files)} shard(s)")
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        return s, i - int(self.starts[s])

    def shard_list(self, root: Optional[str] = None) -> list[list]:
        """``[name, rows]`` of every shard (names relative to ``root`` where under it)."""
        def name(f: str) -> str:
            return os.path.relpath(f, root) if root and os.path.abspath(f).startswith(os.path.abspath(root)) else f
        return [[name(f), n] for f, n in zip(self.files, self.rows)]

    def __getstate__(self) -> dict:  # open files and caches stay in their process (DataLoader workers)
        state = dict(self.__dict__)
        state["_open"], state["_cache"], state["_last"] = {}, OrderedDict(), None
        return state


class ParquetShards(_Rows):
    """Parquet shards' rows, read by row group (module docstring)."""

    kind = "parquet"

    def __init__(self, files: list[Path], columns: Optional[list[str]] = None):
        import pyarrow.parquet as pq

        rows, groups, names = [], [], None
        for f in files:
            try:
                md = pq.read_metadata(str(f))
            except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError
                raise UserError(f"--dataset-path: shard {f} is not a readable parquet file "
                                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
            these = list(md.schema.to_arrow_schema().names)
            if names is None:
                names = these
            elif these != names:
                raise UserError(f"--dataset-path: shard {f} has columns {', '.join(these)}, shard {files[0]} has "
                                f"{', '.join(names)}; every shard of a source needs the same columns")
            rows.append(md.num_rows)
            groups.append(np.concatenate([[0], np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)])])
                          .astype(np.int64))
        super().__init__(files, rows)
        self.column_names = names or []
        self.groups = groups
        self.columns = columns  # the columns rows are read with (None: all)
        self._open: dict = {}
        self._cache: OrderedDict = OrderedDict()

    def _file(self, s: int):
        import pyarrow.parquet as pq

        f = self._open.get(s)
        if f is None:
            if len(self._open) > 8:
                self._open.clear()
            f = self._open[s] = pq.ParquetFile(self.files[s])
        return f

    def _group(self, s: int, g: int):
        key = (s, g)
        table = self._cache.get(key)
        if table is None:
            table = self._file(s).read_row_group(g, columns=self.columns)
            self._cache[key] = table
            while len(self._cache) > CACHED_GROUPS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return table

    def value(self, i: int, column: str) -> Any:
        """Row ``i``'s value of ``column``, as Python objects."""
        s, r = self.locate(i)
        g = int(np.searchsorted(self.groups[s], r, side="right")) - 1
        return self._group(s, g).column(column)[r - int(self.groups[s][g])].as_py()

    def column_chunks(self, column: str, rows: int = 65536) -> Iterator:
        """``column`` over every shard in arrays of up to ``rows`` rows (one array in memory): the
        start-up file check's slices, as large as a loaded dataset's (with one array per 1024-row
        group, checking 1M paths took 1.8x as long as on the loaded rows; now about the same)."""
        for s in range(len(self.files)):
            for batch in self._file(s).iter_batches(batch_size=rows, columns=[column]):
                yield batch.column(0)


def _tar_index(path: str) -> dict:
    """A tar's samples from its member headers: per sample the ``.json`` member's offset and size and
    its image members' (WebDataset grouping: the key is the name up to its basename's first dot;
    consecutive members with one key are one sample; images ordered by their field name)."""
    json_off, json_size, img_off, img_size, img_kind, img_start = [], [], [], [], [], [0]
    key, fields = None, {}

    def close() -> None:
        if key is None:
            return
        if "json" not in fields:
            raise UserError(f"--dataset-path: shard {path}: sample '{key}' has no .json member (it has "
                            f"{', '.join(sorted(fields)) or 'none'}); every sample needs its row as <key>.json")
        json_off.append(fields["json"][0])
        json_size.append(fields["json"][1])
        for name in sorted((n for n in fields if Path("x." + n).suffix.lower() in IMAGE_EXTS + VIDEO_EXTS),
                           key=lambda n: [int(t) if t.isdigit() else t for t in n.split(".")]):
            img_off.append(fields[name][0])
            img_size.append(fields[name][1])
            img_kind.append(int(Path("x." + name).suffix.lower() in VIDEO_EXTS))
        img_start.append(len(img_off))

    try:
        with tarfile.open(path, "r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                folder, _, base = m.name.rpartition("/")
                stem, dot, field = base.partition(".")
                if not dot:
                    continue
                k = f"{folder}/{stem}" if folder else stem
                if k != key:
                    close()
                    key, fields = k, {}
                fields[field.lower()] = (m.offset_data, m.size)
            close()
    except tarfile.ReadError as err:
        raise UserError(f"--dataset-path: shard {path} is not a readable tar ({err}); WebDataset shards are plain "
                        ".tar files") from None
    samples = np.asarray([json_off, json_size, img_start[:-1]], dtype=np.int64).T.reshape(-1, 3)
    samples = np.concatenate([samples, [[0, 0, len(img_off)]]]).astype(np.int64)
    return {"samples": samples,
            "images": np.asarray([img_off, img_size, img_kind], dtype=np.int64).T.reshape(-1, 3)}


def _index_cache_dir() -> Path:
    try:
        import datasets

        return Path(datasets.config.HF_DATASETS_CACHE) / "mimo_sft_tar_index"
    except Exception:  # noqa: BLE001 - no datasets config: the user's cache folder
        return Path.home() / ".cache" / "mimo_sft_tar_index"


def cached_tar_index(path: str) -> dict:
    """:func:`_tar_index`: ``samples`` (per sample the ``.json`` member's offset and size and its first
    image's number, plus one closing row) and ``images`` (offset, size), read memory-mapped from the
    index cache (the node's ranks and workers share one copy in the page cache) or built and written
    there atomically."""
    st = os.stat(path)
    key = hashlib.sha256(f"{TAR_INDEX_VERSION}\0{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    folder = _index_cache_dir()
    files = {name: folder / f"{key}.{name}.npy" for name in ("samples", "images")}
    if all(f.is_file() for f in files.values()):
        try:
            return {name: np.load(f, mmap_mode="r") for name, f in files.items()}
        except (OSError, ValueError):
            pass
    index = _tar_index(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("images", "samples"):  # samples last: a reader that finds it finds both
            tmp = folder / f".{key}.{name}.{os.getpid()}.npy"
            with open(tmp, "wb") as fh:
                np.save(fh, index[name])
            os.replace(tmp, files[name])
    except OSError:
        pass  # a read-only cache: the index is rebuilt next time
    return index


class TarShards(_Rows):
    """WebDataset tar shards' samples: each row is its ``.json`` member's object, plus its image members."""

    kind = "webdataset"

    def __init__(self, files: list[Path]):
        self.index = [cached_tar_index(str(f)) for f in files]
        super().__init__(files, [len(ix["samples"]) - 1 for ix in self.index])
        self._open: dict = {}
        self._cache: OrderedDict = OrderedDict()
        self._last: Optional[tuple[int, dict]] = None

    def _read(self, s: int, off: int, size: int) -> bytes:
        fd = self._open.get(s)
        if fd is None:
            if len(self._open) > 8:
                for old in self._open.values():
                    os.close(old)
                self._open.clear()
            fd = self._open[s] = os.open(self.files[s], os.O_RDONLY)
        return os.pread(fd, int(size), int(off))

    def row(self, i: int) -> dict:
        """Row ``i``: its ``.json`` object (the last one read is kept: a sample's text and, for a sample
        without image members, its images column both come from it)."""
        if self._last is not None and self._last[0] == int(i):
            return self._last[1]
        s, r = self.locate(i)
        off, size, _ = self.index[s]["samples"][r]
        text = self._read(s, off, size)
        try:
            row = json.loads(text)
        except ValueError as err:
            raise UserError(f"--dataset-path: shard {self.files[s]}: sample {r}'s .json member is not JSON ({err})") from None
        if not isinstance(row, dict):
            raise UserError(f"--dataset-path: shard {self.files[s]}: sample {r}'s .json member holds a "
                            f"{type(row).__name__}, not an object with the row's columns")
        self._last = (int(i), row)
        return row

    def images(self, i: int) -> list[bytes]:
        """Row ``i``'s image members' bytes, in field order."""
        return self._members(i, 0)

    def videos(self, i: int) -> list[bytes]:
        """Row ``i``'s clip members' bytes (``<key>.mp4``, ``<key>.1.webm``, ...), in field order."""
        return self._members(i, 1)

    def _members(self, i: int, kind: int) -> list[bytes]:
        s, r = self.locate(i)
        samples, media = self.index[s]["samples"], self.index[s]["images"]
        a, b = int(samples[r][2]), int(samples[r + 1][2])
        return [self._read(s, int(media[j][0]), int(media[j][1])) for j in range(a, b) if int(media[j][2]) == kind]

    def first_row(self) -> dict:
        return self.row(0) if len(self) else {}
