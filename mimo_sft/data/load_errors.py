"""The real cause of a dataset file that ``datasets`` cannot load, as one line naming file and line.

Why: ``datasets`` wraps a parse error of one JSON Lines row in ``DatasetGenerationError: An error
occurred while generating the dataset``; the cause (row, position) sits in the exception chain
and the line number nowhere. For JSON files this re-reads the file with Python's ``json`` to name
the first line that does not parse; for any file it falls back to the innermost cause's message.

A ``.json`` file whose top level is an object (``{"data": [...]}``) loads as ONE row with a
``data`` column; :func:`object_top_level` recognises that shape so the user hears it in one line
rather than a suggestion to point ``--conversations-column`` at it.
"""

from __future__ import annotations

import json
from pathlib import Path


def innermost_cause(err: BaseException) -> BaseException:
    """The deepest exception in ``err``'s cause/context chain (where the parser said what it saw)."""
    seen = {id(err)}
    while True:
        nxt = err.__cause__ or err.__context__
        if nxt is None or id(nxt) in seen:
            return err
        seen.add(id(nxt))
        err = nxt


def _first_bad_json_line(path: Path) -> str | None:
    """``line N: reason`` of the first JSON Lines row that does not parse (None: every line does)."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            text = raw.strip()
            if not text:
                continue
            try:
                json.loads(text)
            except UnicodeDecodeError as err:
                return f"line {number}: not UTF-8 text ({err.reason})"
            except ValueError as err:
                return f"line {number}, column {getattr(err, 'colno', '?')}: {getattr(err, 'msg', err)}"
    return None


def _json_problem(path: Path) -> str | None:
    """Where a .json / .jsonl file stops being valid JSON (whole-file JSON or JSON Lines), or None."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16).lstrip()
    whole_document = path.suffix.lower() == ".json" and head[:1] == b"["
    if not whole_document:
        bad = _first_bad_json_line(path)
        if bad or path.suffix.lower() == ".jsonl":
            return bad
    try:
        with open(path, encoding="utf-8") as fh:
            json.load(fh)
    except UnicodeDecodeError as err:
        return f"not UTF-8 text ({err.reason})"
    except ValueError as err:
        return f"line {getattr(err, 'lineno', '?')}, column {getattr(err, 'colno', '?')}: {getattr(err, 'msg', err)}"
    return None


#: why a source without a single row cannot be loaded (start-up's words, and ``validate``'s from the footers)
NO_ROWS = "it has no rows; give a source that holds samples"


def load_failure(path: Path, err: BaseException) -> str:
    """The clause after ``cannot load`` for a dataset file that failed to load."""
    if path.is_file() and path.suffix.lower() in (".json", ".jsonl"):
        try:
            problem = _json_problem(path)
        except OSError as io_err:
            problem = f"cannot read the file ({io_err})"
        if problem:
            return f"invalid JSON at {problem}; fix or remove that row"
    cause = innermost_cause(err)
    text = str(cause).strip()
    if "BatchSize must be greater than 0" in text:  # pyarrow's word for a source without a single row
        return NO_ROWS
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def object_top_level(ds, path: Path) -> str | None:
    """A one-line explanation when a .json file's top level was an object holding the rows, else None."""
    if path.suffix.lower() != ".json" or len(ds) != 1:
        return None
    row = ds[0]
    # a list of dicts that are not chat turns (those carry "role" / "from"): the samples, one level down
    lists = [k for k, v in row.items() if isinstance(v, list) and v and isinstance(v[0], dict)
             and not ({"role", "from"} & set(v[0]))]
    if not lists:
        return None
    key = lists[0]
    return (f"--dataset-path {path}: the file's top level is an object ({{\"{key}\": [...]}}, keys: "
            f"{', '.join(row)}), which reads as one row; mimo-sft needs one sample per row: make the list the "
            f"top level (e.g. jq '.{key}' {path.name} > rows.json) or write one sample per line (JSON Lines)")
