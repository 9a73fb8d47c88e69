"""The start-up image-file check, streamed chunk by chunk, run once per run (not once per rank).

Why it exists: a dataset of millions of rows that names its images by path should fail before step
0 when files are missing, not hours in. Why it is written this way:

* **streamed**: the path (or message) column is read one Arrow chunk at a time, cut into slices of
  :data:`SLICE_ROWS` rows (zero-copy ``slice``); only the values that name a file become Python
  objects, and only for one slice at a time. No ``combine_chunks`` of a whole column (with image
  bytes inside the dataset that would copy the dataset into every rank's memory);
* **once**: the training loop runs :func:`check_image_files` on one rank and hands the verdict to
  the others (``train.feed``); the verdict is cached in the run's output folder keyed by the
  dataset's fingerprint and image folder (:func:`cached_check`), so a resumed run does not stat the
  files again. Files that go missing later are the bad-sample path's business (``--max-bad-samples``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from mimo_sft.data.image_refs import arrow_storage, image_list, path_of, walk_arrow
from mimo_sft.errors import UserError

#: rows converted to Python objects at a time (a slice of a chunk; memory stays this small)
SLICE_ROWS = 65536
#: missing files named in the error line (the count says how many more)
_NAMED = 3


def _slices(chunked) -> Iterator[tuple[int, Any]]:
    """``(first row, array)`` for every slice of at most :data:`SLICE_ROWS` rows of a ChunkedArray."""
    row = 0
    for chunk in chunked.chunks:
        for off in range(0, len(chunk), SLICE_ROWS):
            yield row + off, chunk.slice(off, SLICE_ROWS)
        row += len(chunk)


def _row_ids(start: int, n: int):
    import pyarrow as pa

    return pa.array(range(start, start + n), pa.int64())


def content_refs(source) -> Iterator[tuple[int, Any]]:
    """(row, reference) of every image named inside message content, in row order, slice by slice."""

    if source.schema != "messages":
        return
    for start, arr in _slices(source.ds.data.table.column(source.text_column)):
        out: list = []
        walk_arrow(arr, _row_ids(start, len(arr)), out)
        yield from sorted(out, key=lambda x: x[0])


def _slice_paths(column, rows) -> list[tuple[int, str]]:
    """(row, path) of one slice of the images column: file paths only, nothing decoded."""
    import pyarrow as pa
    import pyarrow.compute as pc


    column = arrow_storage(column)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        rows = pc.take(rows, pc.list_parent_indices(column))
        column = arrow_storage(pc.list_flatten(column))
    if pa.types.is_struct(column.type):
        names = [column.type.field(i).name for i in range(column.type.num_fields)]
        if "path" not in names:
            return []
        paths = pc.struct_field(column, "path")
        keep = pc.is_valid(paths)
        if "bytes" in names:
            keep = pc.and_(keep, pc.is_null(pc.struct_field(column, "bytes")))
        return list(zip(pc.filter(rows, keep).to_pylist(), pc.filter(paths, keep).to_pylist()))
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return []
    # plain paths, or JSON text (a Json feature) holding a path, a list of paths or a dict
    valid = pc.is_valid(column)
    return [(row, p) for row, value in zip(pc.filter(rows, valid).to_pylist(), pc.filter(column, valid).to_pylist())
            for p in map(path_of, image_list(value)) if p is not None]


def image_paths(source) -> Iterator[tuple[int, str]]:
    """(row, path) of every image stored as a file path, slice by slice, without decoding any image.

    Paths come from the images column, or for a dataset without one from the message content.
    """

    if source.images_column is None:
        yield from ((row, p) for row, ref in content_refs(source) if (p := path_of(ref)) is not None)
        return
    for start, arr in _slices(source.ds.data.table.column(source.images_column)):
        yield from _slice_paths(arr, _row_ids(start, len(arr)))


def check_image_files(source) -> None:
    """Refuse mixed image sources and missing files, naming the first few missing ones."""
    if source.images_column is not None:
        for row, _ref in content_refs(source):
            raise source._both_error(row)
    missing, named = 0, []
    for row, ref in image_paths(source):
        path = source._resolve(ref, row)
        if isinstance(path, Path) and not path.is_file():
            missing += 1
            if len(named) < _NAMED:
                what = "is a folder, not an image file" if path.is_dir() else "not found"
                named.append(f"sample {row}: image file {path} {what}")
    if missing:
        more = f" and {missing - len(named)} more" if missing > len(named) else ""
        raise UserError(f"{'; '.join(named)}{more}; check the paths or set --image-root")


def _cache_key(source) -> str:
    """The dataset's content (datasets' fingerprint), where relative paths point, and the file list's
    size: a change to any of them checks the files again."""
    parts = [getattr(source.ds, "_fingerprint", "") or source.dataset_path, str(source.image_root),
             str(source.base_dir), str(len(source))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def cached_check(source, cache_dir: str | os.PathLike | None) -> str | None:
    """The verdict (None: fine, else the error line) of :func:`check_image_files`, cached in
    ``cache_dir/data_check.json`` when given. Only a passing check is reused: a failing one is
    run again (the user is expected to fix the files). Internal errors of an Arrow layout we do not
    know count as passing, as at load time (the images are still checked when read)."""
    path = Path(cache_dir) / "data_check.json" if cache_dir else None
    key = _cache_key(source)
    if path is not None and path.is_file():
        try:
            if json.loads(path.read_text()).get(key) == "ok":
                return None
        except (OSError, ValueError):
            pass
    try:
        check_image_files(source)
    except UserError as err:
        return str(err)
    except Exception:  # noqa: BLE001 - an Arrow layout we do not know
        return None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({key: "ok"}))
        os.replace(tmp, path)  # atomic: a reader sees the old or the new file
    return None
