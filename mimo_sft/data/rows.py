"""The canonical sample form, and a dataset's rows in it: ``SFTSource[i] -> (messages, image_refs)``.

Why one form: preprocessing should not care whether a row came from a ``messages`` dataset or a
ShareGPT/LLaVA one, or from a ``datasets`` table or shards read in place (``data.streamed``).
``messages`` holds only ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts and
``image_refs`` are undecoded references (bytes, a resolved path, or an in-memory PIL image). Images
are never decoded here: image columns are read as stored (Arrow) so the metadata-only path can read
just the header. A sample's images come from an images column (LLaVA's ``image`` may be one path or a
list) or, in Qwen's own format, from the content parts that name them (``{"type": "image", "image": ...}``).
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

from mimo_sft.data.image_refs import image_list, part_ref
from mimo_sft.errors import BadRowError, BadSampleError, UserError

_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
             "bot": "assistant", "system": "system"}
IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
VIDEO_COLUMNS = ("video", "videos")  # LLaVA-Video's clip column in ShareGPT rows


class _UnnamedImages(UserError):
    """Image placeholders in a row of a dataset without an images column whose content names no image."""


class SFTSource:
    """Rows of a dataset as ``(messages, image_refs)``; picklable for DataLoader workers.

    A sample's images come from the images column, or (datasets without one) from the message
    content itself (Qwen's ``{"type": "image", "image": "a.png"}``); a dataset using both is refused.
    """

    videos_column: str | None = None
    _videos = None
    #: a subset's rows in the file (``data.validation.subset_source``: ``--valid-split``), so a message names
    #: the row a user can find; None: row ``i`` is the file's row ``i``
    file_rows: list[int] | None = None

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
        #: LLaVA-Video's clip column ("video" or "videos"), read with the ``<video>`` markers of ShareGPT rows
        self.videos_column = next((c for c in VIDEO_COLUMNS if c in ds.column_names), None) if schema == "sharegpt" else None
        self._videos = ds.select_columns([self.videos_column]) if self.videos_column else None

    def __len__(self) -> int:
        return len(self.ds)

    def _text_value(self, idx: int):
        return self._text[int(idx)][self.text_column]

    def column_chunks(self, column: str):
        """``column``'s Arrow arrays in row order (the start-up file check streams them)."""
        return self.ds.data.table.column(column).chunks

    def content_key(self) -> str:
        """What names the rows' content (datasets' fingerprint): the file check's cache key."""
        return getattr(self.ds, "_fingerprint", "") or self.dataset_path

    def __getitem__(self, idx: int) -> tuple[list[dict], list[Any]]:
        """``(messages, image refs)`` of row ``idx``; a row that cannot be read as a sample is a ``BadRowError``
        naming where it is (:meth:`row_where`), for the loader to skip and count."""
        try:
            return self._sample(idx)
        except BadSampleError:
            raise
        except UserError as err:
            reason = re.sub(rf"^(--dataset-path[^:]*: )?sample {int(idx)}( of [^:]+)?: ", "", str(err))
            bad = BadRowError(int(idx), self.row_where(idx), reason)
            bad.unnamed_images = isinstance(err, _UnnamedImages)  # checked(): the dataset's layout, maybe
            raise bad from None

    def row_where(self, idx: int) -> str:
        """Where row ``idx`` is, for a message: the source and its row (in the file, for a subset)."""
        return f"{self.dataset_path}, row {int(idx) if self.file_rows is None else self.file_rows[int(idx)]}"

    def _sample(self, idx: int) -> tuple[list[dict], list[Any]]:
        """``(messages, vision refs)``: the refs in the order of the image and video parts (a clip's ref is a
        ``data.video.VideoRef``)."""
        text = self._text_value(idx)
        if self.schema == "messages":
            messages, inline = _canonical_messages(text, idx, self.text_column)
            clips = [c for k, c in inline if k == "video"] or self._column_clips(idx)
            inline = [r for k, r in inline if k == "image"]
        else:
            messages, inline = _sharegpt_messages(text, idx, self.text_column), []
            clips = self._column_clips(idx)
        if inline and self.images_column is not None:
            raise self._both_error(idx)
        raw = inline if inline else self._column_refs(idx)
        refs = [self._resolve(r, idx) for r in raw]
        vision = [p["type"] for m in messages for p in m["content"] if p["type"] in ("image", "video")]
        self._check_count([{"content": [{"type": t} for t in vision if t == "image"]}], refs, idx, inline=bool(inline))
        if vision.count("video") != len(clips):
            raise UserError(f"sample {idx} of {self.dataset_path}: {vision.count('video')} video part(s) or <video> "
                            f"marker(s) in the text but {len(clips)} clip(s) named; name each clip once (a part's "
                            f"'video' key, a 'video' column, or a tar sample's <key>.mp4 members)")
        images, videos = iter(refs), iter(self._video_ref(c, idx) for c in clips)
        return messages, [next(images) if t == "image" else next(videos) for t in vision]

    def _column_clips(self, idx: int) -> list:
        if self._videos is None:
            return []
        return [{"video": v} for v in image_list(self._videos[int(idx)][self.videos_column])]

    def _video_ref(self, part: dict, idx: int):
        """A clip part (``{"video": path | bytes | [frame, ...], "video_start", "video_end", "fps"}``) as a
        ``VideoRef`` with its paths resolved as images' are."""
        from mimo_sft.data.image_refs import VideoRef

        src = part.get("video")
        try:
            start = None if part.get("video_start") is None else float(part["video_start"])
            end = None if part.get("video_end") is None else float(part["video_end"])
            fps = None if part.get("fps") is None else float(part["fps"])
        except (TypeError, ValueError):
            raise UserError(f"sample {idx} of {self.dataset_path}: video_start / video_end / fps must be numbers "
                            "of seconds (frames per second)") from None
        if start is not None and end is not None and start >= end:
            raise UserError(f"sample {idx} of {self.dataset_path}: video_start {start} is not before video_end {end}; "
                            "fix the row")
        if isinstance(src, (list, tuple)):
            return VideoRef(tuple(self._resolve(f, idx) for f in src), start, end, fps)
        return VideoRef(self._resolve(src, idx), start, end, fps)

    def _column_refs(self, idx: int) -> list:
        if self.images_column is None:
            return []
        return image_list(self._images[int(idx)].column(0).to_pylist()[0])

    def _check_count(self, messages, refs, idx, *, inline: bool) -> None:
        """Every image part needs exactly one image; say which source to fix when not."""
        n_parts = sum(1 for m in messages for p in m["content"] if p["type"] == "image")
        if n_parts == len(refs):
            return
        where = f"sample {idx} of {self.dataset_path}: {n_parts} image placeholder(s) in the text but"
        if inline:
            raise UserError(f"{where} only {len(refs)} of them name an image; give every image part an "
                            "'image', 'url' or 'path' key")
        if self.images_column is None:
            raise _UnnamedImages(f"{where} the dataset has no images column; name it with --images-column, or name "
                                 "each image in its content part ({\"type\": \"image\", \"image\": \"a.png\"})")
        raise UserError(f"{where} {len(refs)} image(s) in column '{self.images_column}'; fix the row or point "
                        f"--images-column at the images")

    def _both_error(self, row: int) -> UserError:
        return UserError(f"--dataset-path {self.dataset_path}: sample {row} names its images inside the messages "
                         f"and the dataset also has an images column '{self.images_column}'; keep only one of the "
                         "two (remove the column or the in-content image references)")

    def image_paths(self) -> list[tuple[int, str]]:
        """(row, path) of every image stored as a file path, without decoding any image (streamed
        slice by slice: :func:`mimo_sft.data.file_check.image_paths`)."""
        from mimo_sft.data.file_check import image_paths

        return list(image_paths(self))

    def check_image_files(self) -> None:
        """Refuse mixed image sources and missing files (:func:`mimo_sft.data.file_check.check_image_files`)."""
        from mimo_sft.data.file_check import check_image_files

        check_image_files(self)

    def _resolve(self, ref, idx):
        """bytes -> ``bytes``; path or URI -> absolute ``Path`` / ``bytes``; PIL image -> itself."""
        where = f"column '{self.images_column}'" if self.images_column else "the message content"
        if isinstance(ref, dict):
            if ref.get("bytes"):
                return bytes(ref["bytes"])
            ref = ref.get("path")
            if not ref:
                raise UserError(f"sample {idx} of {self.dataset_path}: image entry has neither bytes nor path; "
                                f"fix {where}")
        if isinstance(ref, (bytes, bytearray)):
            return bytes(ref)
        if isinstance(ref, str):
            return self._resolve_string(ref, idx)
        if isinstance(ref, os.PathLike):
            return self._under_root(Path(ref))
        if hasattr(ref, "size") and hasattr(ref, "mode"):  # PIL image held in memory
            return ref
        raise UserError(f"sample {idx} of {self.dataset_path}: unsupported image value of type {type(ref).__name__} "
                        f"in {where}; use paths, bytes or images")

    def _resolve_string(self, ref: str, idx):
        """A path, ``file://`` URI or base64 ``data:`` URI; http(s) is refused (no network at run time)."""
        if ref.lower().startswith(("http://", "https://")):
            raise UserError(f"sample {idx} of {self.dataset_path}: image {ref} is a remote URL; remote images are not "
                            "fetched (no network at run time): download them and use local paths")
        if ref.startswith("data:"):
            head, _, payload = ref.partition(",")
            try:
                if not head.endswith(";base64"):
                    raise ValueError("not base64")
                return base64.b64decode(payload, validate=True)
            except ValueError:
                raise UserError(f"sample {idx} of {self.dataset_path}: image data URI '{head}' is not base64 image "
                                "data; use 'data:image/...;base64,...' or a path") from None
        if ref.startswith("file://"):  # file:///abs/a.png -> /abs/a.png; file://a.png -> a.png (relative)
            ref = ref[len("file://"):]
        return self._under_root(Path(ref))

    def _under_root(self, p: Path) -> Path:
        """Relative paths resolve against --image-root, else the dataset's folder, else the cwd."""
        p = p.expanduser()
        if not p.is_absolute():
            p = (self.image_root or self.base_dir or Path.cwd()) / p
        return p


def _clean_part(part, idx, col) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise UserError(f"sample {idx}: content parts in column '{col}' must be dicts with 'type'; got {type(part).__name__}")
    kind = part.get("type")
    if kind == "image" or (kind is None and part.get("image") is not None):
        return {"type": "image"}
    if kind == "video" or (kind is None and part.get("video") is not None):
        return {"type": "video"}  # its clip: the part's 'video', else the row's video column or tar members
    if kind == "text" or (kind is None and part.get("text") is not None):
        return {"type": "text", "text": part.get("text") or ""}
    raise UserError(f"sample {idx}: content part type '{kind}' in column '{col}' is not supported; use 'text', 'image' or 'video'")


def _canonical_messages(messages, idx, col) -> tuple[list[dict], list]:
    """(canonical messages, ``("image", ref)`` / ``("video", part)`` the parts name inline, in message order)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError(f"sample {idx}: column '{col}' must hold a non-empty list of messages")
    out, inline = [], []
    for m in messages:
        role = _ROLE_MAP.get(str(m.get("role", "")).lower()) if isinstance(m, dict) else None
        if role is None:
            raise UserError(f"sample {idx}: every message in '{col}' needs a role of system/user/assistant")
        content = m.get("content")
        raw = [content] if isinstance(content, str) else list(content or [])
        parts = [_clean_part(p, idx, col) for p in raw]
        for p, c in zip(raw, parts):
            if c["type"] == "video" and isinstance(p, dict) and p.get("video") not in (None, "", []):
                inline.append(("video", p))
            elif c["type"] == "image" and (r := part_ref(p)) is not None:
                inline.append(("image", r))
        out.append({"role": role, "content": parts})
    return out, inline


def _split_markers(text: str) -> list[dict]:
    parts = []
    pieces = re.split(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})", text)
    for i, piece in enumerate(pieces):
        if i % 2:
            parts.append({"type": "image" if piece == IMAGE_MARKER else "video"})
            continue
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


def pick_columns(data_cfg, cols: list[str]) -> tuple[str, str, str | None]:
    """``(schema, text column, images column or None)`` of a dataset with columns ``cols``."""
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
    return schema, text_column, images_column


def source_folders(data_cfg) -> tuple[Path | None, Path | None]:
    """``(the dataset's folder, --image-root)``: where relative image paths resolve."""
    p = Path(str(data_cfg.dataset_path)).expanduser()
    if any(ch in str(data_cfg.dataset_path) for ch in "*?["):  # a glob of shards: their folder
        p = p.parent
    base_dir = (p if p.is_dir() else p.parent).resolve() if p.exists() else None
    image_root = Path(data_cfg.image_root).expanduser().resolve() if data_cfg.image_root else None
    if image_root is not None and not image_root.is_dir():
        raise UserError(f"--image-root {data_cfg.image_root} is not a folder; point it at the folder the image paths are relative to")
    return base_dir, image_root


def checked(source, *, check_files: bool):
    """``source``, its image files checked (``check_files``) and its first rows read."""
    images_column = source.images_column
    if check_files:
        from mimo_sft.data.file_check import cached_check

        verdict = cached_check(source, None)
        if verdict is not None:
            raise UserError(verdict)
    if images_column is None:
        # Fail now, not mid-training, if the text asks for images the dataset names nowhere (no images column, no
        # image named in any of the first rows' content): that is the dataset's layout. A row bad on its own is the
        # loader's and check-data's, as in a dataset with an images column (skipped with --max-bad-samples, listed).
        unnamed = None
        for i in range(min(len(source), 64)):
            try:
                if source[i][1]:
                    return source
            except BadRowError as err:
                if getattr(err, "unnamed_images", False) and unnamed is None:
                    unnamed = err
        if unnamed is not None:
            raise UserError(str(unnamed))
    return source
