"""What start-up would refuse about a config's sources, found the way ``validate`` can afford: from metadata and
``stat`` calls, never by converting or decoding anything (issue 55 item 2: validate said VALID where finetune
then refused).

Each source -- the training set or a mixture's sources, and the validation sets (``--valid-dataset-path``, a
source's ``valid_path``) -- is opened as far as start-up opens it without ``datasets``' conversion:

* a **streamed** source (``data.streamed``) exactly as start-up does: shard lists, parquet footers, tar headers;
* a **loaded parquet** file or folder (the files ``datasets`` would read for the split, ``data.shards.split_files``)
  by its footers: the schema (the columns start-up picks, :func:`data.rows.pick_columns`) and the row count (a
  source without rows, too few rows for one global batch or for ``--valid-split``), no row group read;
* a **hub name** is refused while the hub is offline, as start-up refuses it (``data.sources.loaded_kind``);
* then, for both kinds, start-up's own file check (``data.file_check``): one ``stat`` per image and clip file its
  rows name, reading only the columns that name files, a batch of rows at a time, plus the first rows of a
  dataset without an images column (``data.rows.checked``).

JSON files and ``save_to_disk`` folders have no footer: start-up and ``check-data`` read them. Every line is the
one start-up raises, with the same source label (``source 'name': ``, ``validation set (...): ``).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from mimo_sft.config.checks.context import looks_local
from mimo_sft.config.checks.validation import held_out, parse_valid_split
from mimo_sft.config.mixture import is_streamed, mixture_specs, path_exists, per_source_validation
from mimo_sft.errors import UserError

#: how start-up names the validation set of ``--valid-dataset-path`` in a line (``data.validation.split_sources``)
VALID_SET = "validation set (--valid-dataset-path, --valid-dataset-split)"


def source_valid_set(name: str, path: str) -> str:
    """How start-up names a mixture source's own validation set (``valid_path``) in a line."""
    return f"validation set of source '{name}' ({path})"


@dataclasses.dataclass(frozen=True)
class _Source:
    label: str  # what start-up puts before the source's lines ("" for one --dataset-path)
    data: object  # the source's DataConfig
    name: Optional[str]  # a training source's name ("" for one --dataset-path); None for a validation set
    check: int  # the check the lines are reported under: 17 (dataset settings) or 28 (validation settings)


def _sources(data_cfg) -> Iterator[_Source]:
    """The sources start-up opens, with the label its lines carry (``data.validation.split_sources``,
    ``data.mixture.load_mixture``)."""
    specs = mixture_specs(data_cfg)
    if specs is not None:
        for spec in specs:
            yield _Source(f"source '{spec.name}': ", spec.data, spec.name, 17)
    else:
        yield _Source("", data_cfg, "", 17)
    if specs is not None and per_source_validation(specs):
        for spec in specs:
            path = spec.data.valid_dataset_path
            if path:
                one = dataclasses.replace(spec.data, dataset_path=path, split=spec.data.valid_dataset_split,
                                          valid_dataset_path=None)
                yield _Source(f"{source_valid_set(spec.name, path)}: ", one, None, 28)
    elif data_cfg.valid_dataset_path:
        one = dataclasses.replace(data_cfg, dataset_path=data_cfg.valid_dataset_path,
                                  split=data_cfg.valid_dataset_split, datasets=[], dataset_weights=None)
        yield _Source(f"{VALID_SET}: ", one, None, 28)


def too_few_samples(n: int, *, micro_batch_size: int, global_batch_size: Optional[int]) -> Optional[str]:
    """Start-up's line for a (non-mixture) training set of ``n`` samples that cannot fill one global batch."""
    need = max(micro_batch_size, global_batch_size or 0)
    if n >= need:
        return None
    which = "--global-batch-size" if global_batch_size and global_batch_size >= micro_batch_size else "--micro-batch-size"
    return (f"the dataset has {n} samples, fewer than one global batch ({which} {need}); "
            "add samples or lower the batch size")


def probe_sources(cfg) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """``(problems, rows)``: ``(check number, line)`` for each refusal start-up would make about the config's
    sources (module docstring), and the row count of each training source that could be counted (by source name;
    ``""`` for one plain ``--dataset-path``)."""
    problems: list[tuple[int, str]] = []
    rows: dict[str, int] = {}
    try:
        sources = list(_sources(cfg.data))
    except UserError:
        return [], {}  # a mixture that does not parse: check 17 says why
    for src in sources:
        try:
            n = _open(src.data)
        except UserError as err:
            problems.extend((src.check, src.label + p) for p in err.problems)
            continue
        if n is not None and src.name is not None:
            rows[src.name] = n
    if not problems:
        problems.extend((17, line) for line in _row_count_problems(cfg, rows))
    return problems, rows


def _row_count_problems(cfg, rows: dict[str, int]) -> list[str]:
    """What start-up says about the training rows it counted: ``--valid-split`` holding out too many (each
    source of a mixture keeps one row; a plain source one global batch), a plain source under one global batch."""
    try:
        split = parse_valid_split(cfg.data.valid_split)
    except ValueError:
        return []  # check 28 says why
    t, mixture = cfg.train, bool(getattr(cfg.data, "datasets", None))
    out = []
    for name, n in rows.items():
        if split is not None:
            n_valid, refused = held_out(n, split, min_train=1 if mixture else t.global_batch_size)
            if refused:
                out.append(f"source '{name}': {refused}" if mixture else refused)
                continue
            n -= n_valid
        line = None if mixture else too_few_samples(n, micro_batch_size=t.micro_batch_size,
                                                    global_batch_size=t.global_batch_size)
        if line:
            out.append(line)
    return out


def _open(one) -> Optional[int]:
    """The rows of one source opened as start-up would (streamed, or a loaded parquet's footers), its files
    checked; None where ``validate`` does not open it (no path, a missing one: checks 17 and 28; a hub name
    while online; a JSON file or ``save_to_disk`` folder). Start-up's refusals are raised as its lines."""
    path = one.dataset_path
    if not path:
        return None  # (nothing imported: validate without data flags stays light)
    from mimo_sft.data.rows import checked
    from mimo_sft.data.sources import loaded_kind
    from mimo_sft.data.streamed import load_streamed_source

    if not path_exists(str(path)):
        if not looks_local(str(path)):  # a hub name: start-up's line while offline (a missing path: checks 17, 28)
            loaded_kind(str(path), one.split)
        return None
    if is_streamed(one):
        # the random-access settings are check 17's own lines (``c17_data``): opened without them, said once
        one = dataclasses.replace(one, dataloader_type="single", valid_split=None)
        return len(load_streamed_source(one, check_files=True))
    kind, where = loaded_kind(str(path), one.split)
    files = [where] if kind == "file" else _folder_files(where, one.split, str(path)) if kind == "folder" else []
    if not files or any(f.suffix.lower() != ".parquet" for f in files):
        return None
    return len(checked(_footer_source(one, files), check_files=True))


def _folder_files(folder, split: str, path_text: str) -> list:
    """The files ``datasets`` reads for ``split`` of a folder (its own resolver: ``data.shards.split_files``)."""
    from mimo_sft.data.shards import split_files

    return split_files(folder, split, path_text)


def _footer_source(one, files):
    """A loaded parquet source read in place from its footers (``data.streamed.StreamedSource`` over
    ``data.shards.ParquetShards``): what start-up would see after ``datasets`` converted it, row for row, with
    start-up's lines for a file that is not parquet, no rows, and columns that do not fit the schema."""
    from mimo_sft.data.load_errors import NO_ROWS
    from mimo_sft.data.rows import VIDEO_COLUMNS, pick_columns, source_folders
    from mimo_sft.data.shards import ParquetShards
    from mimo_sft.data.streamed import StreamedSource

    try:
        shards = ParquetShards(files)
    except UserError as err:  # the streamed reader's words ("shard X is not a readable parquet file (...)")
        raise UserError(f"--dataset-path {one.dataset_path}: cannot load ({str(err).removeprefix('--dataset-path: ')})") from None
    if len(shards) == 0:
        raise UserError(f"--dataset-path {one.dataset_path}: cannot load ({NO_ROWS})")
    schema, text_column, images_column = pick_columns(one, shards.column_names)
    shards.columns = [text_column] + ([images_column] if images_column else [])
    base_dir, image_root = source_folders(one)
    source = StreamedSource(shards, schema=schema, text_column=text_column, images_column=images_column,
                            base_dir=base_dir, image_root=image_root, dataset_path=str(one.dataset_path))
    if schema == "sharegpt":  # LLaVA-Video's clip column: its files are checked as start-up checks them
        source.videos_column = next((c for c in VIDEO_COLUMNS if c in shards.column_names), None)
    return source
