"""Image references inside dataset rows: where a row names its images, and the path a reference points at.

Shared by the source adapter (``data.sources``: a sample's images) and the file check (``data.file_check``:
every referenced path exists before step 0), so neither imports the other. Pure Python over Arrow arrays
and decoded JSON; images are never opened here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INLINE_KEYS = ("image", "url", "path")  # where Qwen / transformers chat messages name an image
INLINE_HINT = r'"(image|url|path)"\s*:'  # JSON text that may hold such a part (cheap pre-filter)
CLIP_HINT = r'"(image|url|path|video)"\s*:'  # ... or a clip part (``{"type": "video", "video": ...}``)


def decode_json_text(value):
    """The object a JSON-text value encodes; any other value unchanged.

    Why: when rows of a JSON file give one key different shapes (LLaVA's ``"image": "a.png"`` next
    to ``"image": ["b.png", "c.png"]``), ``datasets`` stores that column as JSON text, so Arrow
    holds ``'"a.png"'``. Only text that starts like JSON and parses is decoded: ``a.png`` stays a path.
    """
    if isinstance(value, str) and value[:1] in ('"', "[", "{"):
        try:
            return json.loads(value)
        except ValueError:
            pass
    return value


def image_list(raw) -> list:
    """One images-column value (None, one reference, a list, or JSON text of those) as a list."""
    raw = decode_json_text(raw)
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raw = [raw]
    return [decode_json_text(r) for r in raw if r is not None]


def part_ref(part):
    """The image a content part names inline (``{"type": "image", "image"|"url"|"path": ...}``), or None."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    keys = INLINE_KEYS if kind == "image" else ("image",) if kind is None else ()
    for key in keys:
        value = part.get(key)
        if value is not None and not (isinstance(value, str) and not value):
            return value
    return None


def part_clip(part):
    """The clip a content part names (``{"type": "video", "video": path | [frame, ...]}``), or None; as
    ``data.rows`` reads a video part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "video" or (kind is None and part.get("video") is not None):
        value = part.get("video")
        return None if value in (None, "", []) else value
    return None


def clip_files(value) -> list[str]:
    """The files one clip value names: its file, or each file of a frame list (in-dataset bytes name none)."""
    value = decode_json_text(value)
    return [p for item in (value if isinstance(value, (list, tuple)) else [value]) if (p := path_of(item)) is not None]


def path_of(ref) -> str | None:
    """The file path a stored reference points at, or None for in-dataset bytes and data URIs."""
    if isinstance(ref, dict):
        return None if ref.get("bytes") else ref.get("path")
    if isinstance(ref, str) and not ref.startswith("data:"):
        return ref
    return None


def walk_json(value, row: int, out: list, clips: list | None = None) -> None:
    """Collect ``(row, ref)`` of the inline image parts inside decoded JSON (lists/dicts); with ``clips``, also
    ``(row, path)`` of every file a clip part names."""
    if isinstance(value, list):
        for v in value:
            walk_json(v, row, out, clips)
    elif isinstance(value, dict):
        ref = part_ref(value)
        if ref is not None:
            out.append((row, ref))
            return
        if clips is not None and (clip := part_clip(value)) is not None:
            clips.extend((row, p) for p in clip_files(clip))
            return
        for v in value.values():
            if isinstance(v, (list, dict)):
                walk_json(v, row, out, clips)


def arrow_storage(arr):
    """An Arrow array without its extension wrapper: ``datasets``' Json feature is ``arrow.json`` over strings."""
    import pyarrow as pa

    while isinstance(arr.type, pa.BaseExtensionType):
        arr = arr.storage
    return arr


def walk_arrow(arr, rows, out: list, clips: list | None = None) -> None:
    """Collect ``(row, ref)`` of inline image parts under an Arrow array, whatever its nesting; with ``clips``,
    also ``(row, path)`` of the files clip parts name (:func:`walk_json`).

    Why Arrow: this scans the whole dataset when it opens; only the parts that carry an
    image/url/path (or video) value, or JSON text mentioning one, are converted to Python objects.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    is_json = getattr(arr.type, "extension_name", None) == "arrow.json"  # plain text is never parsed
    arr = arrow_storage(arr)
    t = arr.type
    named = INLINE_KEYS + (("video",) if clips is not None else ())
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        walk_arrow(pc.list_flatten(arr), pc.take(rows, pc.list_parent_indices(arr)), out, clips)
    elif pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        keys = [k for k in named if k in names]
        if keys:  # content parts: convert only those naming something
            has = pc.is_valid(pc.struct_field(arr, keys[0]))
            for k in keys[1:]:
                has = pc.or_(has, pc.is_valid(pc.struct_field(arr, k)))
            for row, part in zip(pc.filter(rows, has).to_pylist(), pc.filter(arr, has).to_pylist()):
                walk_json(part, row, out, clips)
        for name in names:
            if name not in named:
                walk_arrow(pc.struct_field(arr, name), rows, out, clips)
    elif is_json and (pa.types.is_string(t) or pa.types.is_large_string(t)):  # Json feature: parts as text
        hit = pc.fill_null(pc.match_substring_regex(arr, INLINE_HINT if clips is None else CLIP_HINT), False)
        for row, text in zip(pc.filter(rows, hit).to_pylist(), pc.filter(arr, hit).to_pylist()):
            walk_json(decode_json_text(text), row, out, clips)


@dataclass(frozen=True)
class VideoRef:
    """A row's video: a file (``Path`` or ``bytes``) or a list of frame images, with an optional window in
    seconds (``video_start`` / ``video_end``); ``fps`` is a frame list's rate (None: ``--video-fps``)."""

    source: Any
    start: float | None = None
    end: float | None = None
    fps: float | None = None

    @property
    def is_frames(self) -> bool:
        return isinstance(self.source, tuple)

    def where(self) -> str | None:
        if isinstance(self.source, (str, Path)):
            return str(self.source)
        if self.is_frames and self.source and isinstance(self.source[0], (str, Path)):
            return f"{self.source[0]} (+{len(self.source) - 1} frames)"
        return None
