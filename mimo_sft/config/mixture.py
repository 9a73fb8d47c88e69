"""Dataset mixtures as settings: which sources, their shares, names and per-source data keys.

Why here and pure (no torch, no ``datasets``): the config checks (check 17, check 35) must judge a
mixture before any process starts, and the data layer (``data.mixture``) builds the same list when
it loads the sources, so both read it from :func:`mixture_specs`.

A mixture comes from ``data.datasets`` (YAML: a list of ``{path, weight, name, split, schema,
messages_column, images_column, conversations_column, image_root, valid_path,
valid_dataset_split, streaming}``; each key but ``path`` optional, the data keys defaulting to the ``data:``
section's) or from ``--dataset-path`` given several times (``config.loader`` turns those into
``data.datasets`` entries), weighted by ``--dataset-weights 0.5,0.3,0.2`` (which overrides the
entries' ``weight``; without either every source weighs the same). Shares are the weights
normalised to sum 1. A source's name (metric keys ``loss/<name>``) is ``name:`` or its file or
folder stem; names are kept to letters, digits, ``._-``.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mimo_sft.errors import UserError

#: the per-source keys of a ``data.datasets`` entry that override the ``data:`` section's
OVERRIDES = ("split", "schema", "messages_column", "images_column", "conversations_column", "image_root",
             "valid_dataset_split", "streaming")
KEYS = ("path", "weight", "name", "valid_path") + OVERRIDES


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture: its name, its share of the drawn samples, its own data config (the
    ``data:`` section with this source's path and overrides; ``datasets`` empty)."""

    name: str
    weight: float  # the normalised share, in [0, 1]
    data: object  # a DataConfig


def _stem(path: str) -> str:
    """A readable name for a source from its path: a file's name without its data suffix (``docs.jsonl`` ->
    ``docs``), a folder's name, a glob's folder (``/data/web/shard-*.tar`` -> ``web``) or, in the current folder,
    its pattern without wildcards (``shard-*.tar`` -> ``shard``). Letters of any script are kept."""
    p = Path(str(path).rstrip("/"))
    if any(ch in p.name for ch in "*?["):
        parent = p.parent.name
        stem = parent if parent not in ("", ".", "..") else re.sub(r"[*?\[\]]+", "", p.name.split(".")[0]).strip("-_.")
    else:
        stem = p.stem if p.suffix.lower() in (".parquet", ".json", ".jsonl", ".arrow", ".tar") else p.name
    return metric_name(stem)


def metric_name(text: str) -> str:
    """``text`` as a stable, readable metric key part (``loss/<name>``): letters of any script, digits and
    ``_.-`` kept, every other run of characters (spaces, ``/``) one ``_``."""
    return re.sub(r"[^\w.-]+", "_", str(text)).strip("_") or "source"


def echo(text, limit: int = 80) -> str:
    """``text`` as an error line repeats it: whole when short, else its start and its length (a 20,000-entry
    weight list must not make a 120 KB line)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_weights(text: Optional[str]) -> Optional[list[float]]:
    """``"0.5,0.3,0.2"`` -> floats (None when unset); a word that is not a number is refused."""
    if text is None or str(text).strip() == "":
        return None
    out = []
    for word in str(text).split(","):
        try:
            out.append(float(word))
        except ValueError:
            raise UserError(f"--dataset-weights {echo(text)}: '{echo(word.strip(), 40)}' is not a number; give one weight per "
                            "--dataset-path, e.g. 0.5,0.3,0.2") from None
    return out


def mixture_specs(data_cfg) -> Optional[list[SourceSpec]]:
    """The sources of ``data_cfg`` (None: one plain ``--dataset-path``); every bad input raises one
    ``UserError`` naming the source (use :func:`mixture_problems` for all of them)."""
    problems = mixture_problems(data_cfg)
    if problems:
        raise UserError(problems[0], problems=problems)
    return _specs(data_cfg)


def mixture_problems(data_cfg) -> list[str]:
    """One line per bad input of the mixture settings (empty: fine, or no mixture)."""
    entries = data_cfg.datasets
    weights_text = getattr(data_cfg, "dataset_weights", None)
    problems: list[str] = []
    try:
        flag_weights = parse_weights(weights_text)
    except UserError as e:
        return [str(e)]
    if not entries:
        if flag_weights is not None and len(flag_weights) != 1:
            problems.append(f"--dataset-weights {echo(weights_text)}: {len(flag_weights)} weights for 1 --dataset-path; "
                            "give one weight per --dataset-path (repeat --dataset-path for each source)")
        return problems
    if data_cfg.dataset_path:
        problems.append(f"--dataset-path {data_cfg.dataset_path} and data.datasets are both set; give the sources "
                        "once (repeat --dataset-path, or list them under data.datasets)")
    labels = []
    for i, e in enumerate(entries):
        where = f"data.datasets[{i}]"
        if not isinstance(e, dict):
            problems.append(f"{where}: expected a mapping such as {{path: a.parquet, weight: 0.5}}, got {e!r}")
            labels.append(where)
            continue
        unknown = [k for k in e if k not in KEYS]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"{where}: unknown key '{unknown[0]}'{hint}; keys: {', '.join(KEYS)}")
        if not e.get("path") or not isinstance(e.get("path"), str):
            problems.append(f"{where}: 'path' is missing; give the source's file or folder")
        labels.append(f"source '{e.get('name') or _stem(e.get('path') or where)}' ({e.get('path')})")
    if problems:
        return problems
    if flag_weights is not None:
        if len(flag_weights) != len(entries):
            return [f"--dataset-weights {echo(weights_text)}: {len(flag_weights)} weights for {len(entries)} sources "
                    f"({echo(', '.join(e['path'] for e in entries), 200)}); give one weight per source"]
        weights = flag_weights
    else:
        weights = []
        for label, e in zip(labels, entries):
            w = e.get("weight", 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                problems.append(f"{label}: weight {w!r} is not a number; give a weight >= 0")
                w = 1.0
            weights.append(float(w))
    for label, w in zip(labels, weights):
        if w < 0 or w != w or w == float("inf"):
            problems.append(f"{label}: weight {w:g} is negative or not finite; give a weight >= 0")
    if not problems and sum(weights) <= 0:
        problems.append(f"--dataset-weights: every weight is 0 ({', '.join(labels)}); give at least one "
                        "source a weight > 0")
    names = [e.get("name") for e in entries]
    given = [n for n in names if n]
    for n in given:
        if given.count(n) > 1:
            problems.append(f"data.datasets: name '{n}' is given to {given.count(n)} sources; give each a name "
                            "of its own")
            break
    return problems


def _specs(data_cfg) -> Optional[list[SourceSpec]]:
    entries = data_cfg.datasets
    if not entries:
        return None
    weights = parse_weights(getattr(data_cfg, "dataset_weights", None)) or [float(e.get("weight", 1.0)) for e in entries]
    total = sum(weights)
    names, seen = [], set()
    for e in entries:
        base = metric_name(e["name"]) if e.get("name") else _stem(e["path"])
        name, k = base, 2
        while name in seen:  # two files of the same stem: a/train.parquet, b/train.parquet
            name, k = f"{base}-{k}", k + 1
        seen.add(name)
        names.append(name)
    specs = []
    for e, w, name in zip(entries, weights, names):
        over = {k: e[k] for k in OVERRIDES if k in e}
        data = dataclasses.replace(data_cfg, datasets=[], dataset_weights=None, dataset_path=e["path"],
                                   valid_dataset_path=e.get("valid_path"), **over)
        specs.append(SourceSpec(name, w / total, data))
    return specs


def dataset_label(data_cfg) -> str:
    """What names a run's training data in a line or a JSON field: ``--dataset-path``, or a mixture's sources
    (``name=path, ...``), never ``None``."""
    if getattr(data_cfg, "datasets", None):
        try:
            return ", ".join(f"{s.name}={s.data.dataset_path}" for s in mixture_specs(data_cfg))
        except UserError:
            return ", ".join(str(e.get("path")) for e in data_cfg.datasets)
    return str(data_cfg.dataset_path)


def source_lines(cfg, rows: dict[str, int]) -> list[str]:
    """One line per source of a mixture for ``validate``: its share, whether it is streamed, its row count where
    known (``rows``: by name, the streamed sources validate opened) and how many times the run reads it over
    ``--train-iters`` (a 4-row source at weight 0.9 is read 28 times in 30 steps of 4)."""
    try:
        specs = mixture_specs(cfg.data)
    except UserError:
        return []
    if not specs:
        return []
    drawn = cfg.train.train_iters * cfg.train.global_batch_size
    lines = []
    for s in specs:
        n = rows.get(s.name)
        epochs = (f"{n} rows, read {s.weight * drawn / n:.2f} times over --train-iters {cfg.train.train_iters}" if n
                  else "rows not counted by validate (check-data counts them)")
        lines.append(f"source '{s.name}' ({s.data.dataset_path}): {100 * s.weight:.1f}% of the samples "
                     f"(~{s.weight * drawn:.0f} draws), {'streamed' if is_streamed(s.data) else 'loaded'}; {epochs}")
    return lines


def per_source_validation(specs: list[SourceSpec]) -> bool:
    """Whether the sources name validation sets of their own (a source without one is not evaluated)."""
    return any(s.data.valid_dataset_path for s in specs)


def is_streamed(data_cfg) -> bool:
    """Whether one source's config reads shards in place (``data.streamed``): ``streaming`` set, or
    WebDataset ``.tar`` shards (a tar file, a glob of them, or a folder holding them)."""
    if getattr(data_cfg, "streaming", False):
        return True
    path = str(getattr(data_cfg, "dataset_path", None) or "")
    if not path:
        return False
    if path.lower().endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")):
        return True  # a compressed tar too: the streamed reader names it and says to decompress it
    folder = os.path.expanduser(path)
    return os.path.isdir(folder) and any(n.lower().endswith(".tar") for n in os.listdir(folder))


def path_exists(path: str) -> bool:
    """A file or folder, or a glob matching one (a streamed source's shards)."""
    if any(ch in path for ch in "*?["):
        return bool(glob.glob(os.path.expanduser(path)))
    return os.path.exists(os.path.expanduser(path))


def random_access_problems(data_cfg, label: str) -> list[str]:
    """One line per setting that a streamed source (``label``) cannot serve without random access."""
    out = []
    tars = not getattr(data_cfg, "streaming", False)  # streamed for being WebDataset tars, not for the flag
    if getattr(data_cfg, "dataloader_type", "single") == "cyclic":
        out.append(f"{label} is streamed (shards read in order): --dataloader-type cyclic reshuffles every row "
                   "of it each epoch, which needs random access; use --dataloader-type single (shuffle the rows "
                   "once when writing the shards)" + ("" if tars else ", or drop --streaming to load it through datasets"))
    if getattr(data_cfg, "valid_split", None) not in (None, "", "0"):
        out.append(f"{label} is streamed: --valid-split holds out random rows of it, which needs random access; "
                   "give its validation set with --valid-dataset-path instead")
    return out
