"""The start-up image- and clip-file check, streamed chunk by chunk, run once per run (not once per rank).

Why it exists: a dataset of millions of rows that names its images and clips by path should fail before
step 0 when files are missing, not hours in (a missing clip was found only when its row was read, and
skipped, while a missing image stopped the run: both are one ``stat`` here). Why it is written this way:

* **streamed**: the path (or message) column is read one Arrow chunk at a time, cut into slices of
  :data:`SLICE_ROWS` rows (zero-copy ``slice``); only the values that name a file become Python
  objects, and only for one slice at a time. No ``combine_chunks`` of a whole column (with image
  bytes inside the dataset that would copy the dataset into every rank's memory);
* **once**: the training loop runs :func:`check_image_files` on one rank and hands the verdict to
  the others (``train.feed``); the verdict is cached in the run's output folder keyed by the
  dataset's fingerprint and image folder (:func:`cached_check`), so a resumed run does not stat the
  files again. Files that go missing later are the bad-sample path's business (``--max-bad-samples``);
* **threaded when it pays**: the paths of a slice are cut into tasks of :data:`_TASK_PATHS`.
  ``os.stat`` releases the GIL, so on a network filesystem (NFS, Lustre: a metadata round trip per
  file) :data:`STAT_THREADS` threads keep that many requests in flight instead of one; with cached
  metadata (a local disk) the loop is CPU-bound and stays on one thread (threads only contend for
  the GIL there). Tasks are collected in submission order and at most
  ``2 * threads`` are in flight, so the error still names the first missing files in row order and
  memory stays a few slices' worth. Plain relative and absolute paths are joined as strings (no
  ``Path`` object per file); URIs and ``~`` go through the source's own resolution (and errors).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from mimo_sft.data.image_refs import arrow_storage, image_list, path_of, walk_arrow
from mimo_sft.errors import UserError

#: rows converted to Python objects at a time (a slice of a chunk; memory stays this small)
SLICE_ROWS = 65536
#: missing files named in the error line (the count says how many more)
_NAMED = 3
#: threads that stat() paths at once (network filesystems gain up to 16-64 requests in flight)
STAT_THREADS = 32
#: paths one thread task stats
_TASK_PATHS = 1024
#: seconds per path under which the check stays on the calling thread: cached metadata costs ~4-8 us
#: a path on this 2-core machine, nearly all of it Python (1M cached paths: 3.9 s on one thread, 6.9 s
#: on 32); a network filesystem's metadata round trip is 0.1-1 ms (the issue's 5M paths in 8-80 min)
_SERIAL_S = 50e-6
#: what ``Path.is_file`` reads as "no such file" rather than raising (CPython's _IGNORED_ERRNOS)
_NOT_FOUND = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)


def _slices(chunks) -> Iterator[tuple[int, Any]]:
    """``(first row, array)`` for every slice of at most :data:`SLICE_ROWS` rows of a column's chunks
    (``source.column_chunks``: a ChunkedArray's, or a streamed source's row groups)."""
    row = 0
    for chunk in chunks:
        for off in range(0, len(chunk), SLICE_ROWS):
            yield row + off, chunk.slice(off, SLICE_ROWS)
        row += len(chunk)


def _row_ids(start: int, n: int):
    import pyarrow as pa

    return pa.array(range(start, start + n), pa.int64())


def _content_slices(source) -> Iterator[list[tuple[int, Any]]]:
    """(row, reference) of the images named inside message content, one slice's list at a time."""
    for images, _clips in _content_parts(source, clips=False):
        yield images


def _content_parts(source, *, clips: bool) -> Iterator[tuple[list, list]]:
    """``(images, clip files)`` named inside message content, each ``(row, reference)`` in row order, one slice
    at a time (``clips=False``: no clip is looked at)."""
    if source.schema != "messages":
        return
    for start, arr in _slices(source.column_chunks(source.text_column)):
        out: list = []
        files: list | None = [] if clips else None
        walk_arrow(arr, _row_ids(start, len(arr)), out, files)
        yield sorted(out, key=lambda x: x[0]), sorted(files or [], key=lambda x: x[0])


def content_refs(source) -> Iterator[tuple[int, Any]]:
    """(row, reference) of every image named inside message content, in row order, slice by slice."""
    for refs in _content_slices(source):
        yield from refs


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


def _path_slices(source) -> Iterator[list[tuple[int, str]]]:
    """:func:`image_paths`, one slice's list at a time."""
    if source.images_column is None:
        for refs in _content_slices(source):
            yield [(row, p) for row, ref in refs if (p := path_of(ref)) is not None]
        return
    for start, arr in _slices(source.column_chunks(source.images_column)):
        yield _slice_paths(arr, _row_ids(start, len(arr)))


def _media_slices(source) -> Iterator[list[tuple[int, Any, str]]]:
    """``(row, reference, what)`` of every image (``what``: ``"image"``) and clip file (``"video"``) stored as
    a file path, one slice at a time. Images come from the images column, else from the message content; clips
    from the message content (a video part's file or frames) or ShareGPT's video column. A dataset that names
    images both in an images column and inside its messages is refused here (``SFTSource._both_error``)."""
    if source.images_column is None:
        for images, clips in _content_parts(source, clips=True):
            yield ([(row, p, "image") for row, ref in images if (p := path_of(ref)) is not None]
                   + [(row, p, "video") for row, p in clips])
    else:
        for start, arr in _slices(source.column_chunks(source.images_column)):
            yield [(row, p, "image") for row, p in _slice_paths(arr, _row_ids(start, len(arr)))]
        for images, clips in _content_parts(source, clips=True):
            if images:
                raise source._both_error(images[0][0])
            yield [(row, p, "video") for row, p in clips]
    videos = getattr(source, "videos_column", None)
    if videos is not None:
        for start, arr in _slices(source.column_chunks(videos)):
            yield [(row, p, "video") for row, p in _slice_paths(arr, _row_ids(start, len(arr)))]


def image_paths(source) -> Iterator[tuple[int, str]]:
    """(row, path) of every image stored as a file path, slice by slice, without decoding any image.

    Paths come from the images column, or for a dataset without one from the message content.
    """
    for paths in _path_slices(source):
        yield from paths


def _missing(source, prefix: str, pairs: list[tuple[int, Any, str]]) -> tuple[int, list[str]]:
    """(missing files, the first :data:`_NAMED` error parts) among ``(row, reference, what)``, in their order
    (one task)."""
    missing, named = 0, []
    for row, ref, what in pairs:
        if not isinstance(ref, str):  # not from an Arrow string column: the source's rules decide
            resolved = source._resolve(ref, row)
            if not isinstance(resolved, Path):
                continue
            ref = str(resolved)
        first = ref[:1]
        if first == "/":
            path = ref
        elif first == "~" or ref[:8].lower().startswith(("file://", "http://", "https://")):
            path = str(source._resolve(ref, row))  # URIs and home folders: the source's rules and errors
        else:  # relative: what SFTSource._under_root gives, joined as a string
            path = prefix + ref
        try:
            mode = os.stat(path).st_mode
        except ValueError:  # an embedded NUL byte: Path.is_file says False
            mode = 0
        except OSError as err:
            if err.errno not in _NOT_FOUND:
                raise
            mode = 0
        if stat.S_ISREG(mode):
            continue
        missing += 1
        if len(named) < _NAMED:
            state = f"is a folder, not an {what} file" if stat.S_ISDIR(mode) else "not found"
            named.append(f"sample {row}: {what} file {source._resolve(ref, row)} {state}")
    return missing, named


def check_image_files(source, *, threads: int = STAT_THREADS) -> None:
    """Refuse mixed image sources and missing image and clip files, naming the first few missing ones (images
    in row order, then clips: :func:`_media_slices`). A clip is treated as an image is: one ``stat`` of each
    file it names (its file, or each frame of a frame list), nothing decoded.

    Tasks run on the calling thread while a path costs less than :data:`_SERIAL_S` (cached metadata:
    the loop is CPU-bound and more threads only contend for the GIL); the first slower task (a
    metadata round trip per file: network filesystems, a cold disk) hands the rest to ``threads``."""
    root = str(source.image_root or source.base_dir or Path.cwd())
    prefix = root if root.endswith(os.sep) else root + os.sep
    missing, named = 0, []
    pending: deque = deque()

    def add(result) -> None:
        nonlocal missing
        missing += result[0]
        named.extend(result[1][:_NAMED - len(named)])

    pool = None
    try:
        for paths in _media_slices(source):
            for off in range(0, len(paths), _TASK_PATHS):
                task = paths[off:off + _TASK_PATHS]
                if pool is None:
                    t0 = time.perf_counter()
                    add(_missing(source, prefix, task))
                    if threads > 1 and time.perf_counter() - t0 > _SERIAL_S * len(task):
                        pool = ThreadPoolExecutor(threads, thread_name_prefix="file-check")
                    continue
                pending.append(pool.submit(_missing, source, prefix, task))
                if len(pending) >= 2 * threads:
                    add(pending.popleft().result())
        while pending:
            add(pending.popleft().result())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if missing:
        more = f" and {missing - len(named)} more" if missing > len(named) else ""
        raise UserError(f"{'; '.join(named)}{more}; check the paths or set --image-root")


def _cache_key(source) -> str:
    """The dataset's content (datasets' fingerprint), where relative paths point, and the file list's
    size: a change to any of them checks the files again."""
    parts = [source.content_key(), str(source.image_root),
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
        try:  # keep the other datasets' verdicts (the training and the validation set share the file)
            known = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            known = {}
        tmp.write_text(json.dumps({**(known if isinstance(known, dict) else {}), key: "ok"}))
        os.replace(tmp, path)  # atomic: a reader sees the old or the new file
    return None
