"""Streamed sources: parquet or WebDataset shards read in place, as an ``SFTSource`` (``data.shards``).

Why a subclass and not a second sample path: a streamed row goes through the very canonicalisation,
image resolution and count checks of a ``datasets`` row (``SFTSource``), so a shard read in place
and the same rows loaded through ``datasets`` give the same samples (tests/test_streamed_source.py).
Only where a row's values come from differs (``_text_value``, ``_column_refs``, ``column_chunks``).

What a streamed source does not do, refused before step 0 (``config.checks``) and here: anything
that reads rows at random over the whole source -- ``--dataloader-type cyclic`` (a permutation of
every row: one row group per sample) and ``--valid-split`` (a random held-out subset). Rows are
read in shard order; shuffle the rows once when writing the shards, and give the validation set as
``--valid-dataset-path``.

A resume needs no replay: the sampler's position gives the row, and the row its shard
(:func:`stream_position`, recorded in the checkpoint's ``meta.json``); a resume on shards whose
names or row counts changed is refused (:func:`check_resumed_streams`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from mimo_sft.data.image_refs import image_list
from mimo_sft.config.mixture import random_access_problems
from mimo_sft.data.shards import ParquetShards, TarShards, files_key, find_shards
from mimo_sft.data.rows import SFTSource, checked, pick_columns, source_folders
from mimo_sft.errors import UserError

class StreamedSource(SFTSource):
    """Rows of parquet or WebDataset shards as ``(messages, image_refs)``; picklable for workers."""

    streaming = True

    def __init__(self, shards, *, schema: str, text_column: str, images_column: Optional[str],
                 base_dir: Optional[Path], image_root: Optional[Path], dataset_path: str):
        self.ds = None
        self.shards = shards
        self.schema, self.text_column, self.images_column = schema, text_column, images_column
        self.base_dir, self.image_root, self.dataset_path = base_dir, image_root, dataset_path
        self._key = files_key(shards.files)

    def __len__(self) -> int:
        return len(self.shards)

    def _text_value(self, idx: int):
        if self.shards.kind == "webdataset":
            return self.shards.row(idx).get(self.text_column)
        return self.shards.value(idx, self.text_column)

    def _column_refs(self, idx: int) -> list:
        if self.images_column is None:
            return []
        if self.shards.kind == "webdataset":
            members = self.shards.images(idx)
            if members:
                return members
            return image_list(self.shards.row(idx).get(self.images_column))
        return image_list(self.shards.value(idx, self.images_column))

    def _column_clips(self, idx: int) -> list:
        """A tar sample's clip members (``<key>.mp4``, ...) as its clips; parquet rows name theirs inline."""
        if self.shards.kind != "webdataset":
            return []
        return [{"video": member} for member in self.shards.videos(idx)]

    def column_chunks(self, column: str):
        """Parquet: the column row group by row group. WebDataset: nothing (a sample's images are its
        members; paths inside its ``.json`` are checked when the sample is read)."""
        if self.shards.kind == "webdataset":
            return iter(())
        return self.shards.column_chunks(column)

    def content_key(self) -> str:
        return f"shards:{self._key}"

    def shard_list(self) -> list[list]:
        """``[shard, rows]`` of every shard (names relative to the source's folder)."""
        return self.shards.shard_list(str(self.base_dir) if self.base_dir else None)

    def row_where(self, idx: int) -> str:
        where = self.position(idx)
        return f"{self.dataset_path}: shard {where['shard']}, row {where['row_in_shard']}"

    def _check_count(self, messages, refs, idx, *, inline: bool) -> None:
        """A tar sample's images are its image members (or the paths its .json names): say so, not a column."""
        if self.shards.kind != "webdataset" or inline:
            return super()._check_count(messages, refs, idx, inline=inline)
        n_parts = sum(1 for m in messages for p in m["content"] if p["type"] == "image")
        if n_parts != len(refs):
            raise UserError(f"{n_parts} image placeholder(s) in its .json but {len(refs)} image(s): {len(refs)} image "
                            f"member(s) (<key>.png, <key>.<i>.jpg, ...) and no paths under '{self.images_column}' in "
                            f"its .json make up the difference; add the missing image members to the tar, or fix the "
                            f"sample's text")

    def position(self, row: int) -> dict:
        """Where row ``row`` lies: its shard and its row in that shard."""
        s, r = self.shards.locate(row)
        return {"shard": self.shard_list()[s][0], "row_in_shard": r}


def load_streamed_source(data_cfg, *, check_files: bool = True) -> StreamedSource:
    """Open ``data_cfg.dataset_path``'s shards (metadata only) and pick the schema and columns."""
    problems = random_access_problems(data_cfg, f"--dataset-path {data_cfg.dataset_path}")
    if problems:
        raise UserError(problems[0], problems=problems)
    kind, files = find_shards(str(data_cfg.dataset_path), split=data_cfg.split)
    if kind == "webdataset":
        shards: Any = TarShards(files)
        if len(shards) == 0:
            raise UserError(f"--dataset-path {data_cfg.dataset_path} has no samples in its {len(files)} tar shard(s)")
        first = shards.first_row()
        # a sample's images are its image members, else the images column of its .json
        schema, text_column, _ = pick_columns(data_cfg, list(first) + [data_cfg.images_column])
        images_column = data_cfg.images_column
        if images_column not in first and schema == "sharegpt" and "image" in first:
            images_column = "image"  # LLaVA's single-image key
    else:
        shards = ParquetShards(files)
        schema, text_column, images_column = pick_columns(data_cfg, shards.column_names)
        shards.columns = [text_column] + ([images_column] if images_column else [])
        if len(shards) == 0:
            raise UserError(f"--dataset-path {data_cfg.dataset_path} has no rows in its {len(files)} parquet shard(s)")
    base_dir, image_root = source_folders(data_cfg)
    source = StreamedSource(shards, schema=schema, text_column=text_column, images_column=images_column,
                            base_dir=base_dir, image_root=image_root, dataset_path=str(data_cfg.dataset_path))
    return checked(source, check_files=check_files)


def stream_position(source, consumed_samples: int, *, seed: int, micro_batch_size: int, drop_last: bool) -> dict:
    """Where every streamed source stands after ``consumed_samples`` stream positions: per source its
    draws, epoch, next row, that row's shard and row in it, and the shard list (empty: none streamed).
    A mixture's draws come from its interleave (``MixtureOrder.draws_before``); one source is read in
    order, ``samples_per_epoch`` positions an epoch (``data.sampler``)."""
    parts = getattr(source, "parts", None)
    if parts is None:
        parts, names, draws = [source], ["dataset"], [int(consumed_samples)]
        n = len(source)
        per_epoch = (n // micro_batch_size if drop_last else -(-n // micro_batch_size)) * micro_batch_size
    else:
        names, draws, per_epoch = source.names, source.order(seed=seed, shuffle=False).draws_before(consumed_samples), None
    out = {}
    for name, part, n in zip(names, parts, draws):
        if not getattr(part, "streaming", False):
            continue
        epoch, j = divmod(int(n), per_epoch or len(part))
        row = j % len(part)
        out[name] = {"draws": int(n), "epoch": epoch, "next_row": row, **part.position(row),
                     "shards": part.shard_list()}
    return out


def check_resumed_streams(saved: Optional[dict], now: dict, *, checkpoint: str) -> None:
    """A resume must read the shards the checkpoint read: a row number names another sample when a
    shard was added, removed, reordered or rewritten with other row counts."""
    for name, pos in (saved or {}).items():
        cur = now.get(name)
        if cur is None:
            continue  # no longer streamed: the mixture check names a changed source
        if [list(x) for x in pos.get("shards", [])] != [list(x) for x in cur["shards"]]:
            raise UserError(f"--load-checkpoint {checkpoint}: the shards of streamed source '{name}' differ from "
                            f"the checkpoint's ({len(pos.get('shards', []))} shards then, {len(cur['shards'])} now, or "
                            "other names or row counts); resume on the same shards, or start from its weights with "
                            f"--pretrained-checkpoint {checkpoint}")
