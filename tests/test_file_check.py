"""The start-up image-file check on threads (issue 33): the same verdict as one thread, the first
missing files named in row order however the threads finish, and verdicts of two datasets kept
side by side in the run folder's cache."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
from PIL import Image

from mimo_sft.config.schema import DataConfig
from mimo_sft.errors import UserError


def _dataset(tmp_path, rows: int, missing: set[int], *, name="d.jsonl", folder_at: int | None = None):
    """``rows`` rows naming ``imgs/pI.png`` (relative), every 5th by absolute path, the rows in
    ``missing`` naming files that do not exist, ``folder_at`` naming a folder."""
    (tmp_path / "imgs").mkdir(exist_ok=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "real.png")
    out = []
    for i in range(rows):
        rel = f"imgs/gone{i}.png" if i in missing else "imgs/real.png"
        if i == folder_at:
            rel = "imgs"
        ref = str(tmp_path / rel) if i % 5 == 0 else rel
        out.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
                    "images": [ref]})
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in out))
    return path


def _verdict(source, **kw) -> str | None:
    from mimo_sft.data.file_check import check_image_files

    try:
        check_image_files(source, **kw)
    except UserError as err:
        return str(err)
    return None


def test_threads_name_the_first_missing_files_in_row_order(tmp_path, monkeypatch):
    """3000 rows in tasks of 7 paths on 8 threads, each stat() delayed at random so later tasks often
    finish first: the line names rows 11, 12 and 1500 (the lowest), counts the rest, and equals the
    one-thread verdict; the pool really ran (stat() was called from its threads)."""
    from mimo_sft.data import file_check
    from mimo_sft.data.sources import load_sft_dataset

    missing = {2999, 1500, 11, 12, 2001, 2500}
    source = load_sft_dataset(DataConfig(dataset_path=str(_dataset(tmp_path, 3000, missing))), check_files=False)
    serial = _verdict(source, threads=1)
    assert serial == (f"sample 11: image file {tmp_path}/imgs/gone11.png not found; sample 12: image file "
                      f"{tmp_path}/imgs/gone12.png not found; sample 1500: image file {tmp_path}/imgs/gone1500.png "
                      f"not found and 3 more; check the paths or set --image-root")
    real_stat, threads, rng = os.stat, set(), random.Random(0)

    def slow_stat(path, *a, **kw):  # latency injected: a metadata round trip of 0-0.3 ms
        threads.add(threading.current_thread().name)
        time.sleep(rng.random() * 3e-4)
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(file_check, "_TASK_PATHS", 7)
    monkeypatch.setattr(file_check.os, "stat", slow_stat)
    assert _verdict(source, threads=8) == serial
    assert any(name.startswith("file-check") for name in threads), threads


def test_a_folder_uris_and_home_folders_are_named_as_the_source_resolves_them(tmp_path):
    """A folder where a file should be is named as such; file:// URIs, ``~`` and remote URLs go
    through the source's own resolution (and its one-line refusal of a URL)."""
    from mimo_sft.data.sources import load_sft_dataset

    path = _dataset(tmp_path, 40, {7}, folder_at=3)
    source = load_sft_dataset(DataConfig(dataset_path=str(path)), check_files=False)
    assert _verdict(source) == (f"sample 3: image file {tmp_path}/imgs is a folder, not an image file; sample 7: "
                                f"image file {tmp_path}/imgs/gone7.png not found; check the paths or set --image-root")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[5]["images"] = ["file://imgs/nope.png"]
    rows[3]["images"] = ["imgs/real.png"]
    rows[7]["images"] = ["~/surely/not/here.png"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    source = load_sft_dataset(DataConfig(dataset_path=str(path)), check_files=False)
    home = os.path.expanduser("~")
    assert _verdict(source) == (f"sample 5: image file {tmp_path}/imgs/nope.png not found; sample 7: image file "
                                f"{home}/surely/not/here.png not found; check the paths or set --image-root")
    rows[9]["images"] = ["https://example.com/a.png"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    source = load_sft_dataset(DataConfig(dataset_path=str(path)), check_files=False)
    assert "sample 9 of" in _verdict(source) and "is a remote URL" in _verdict(source)


def test_two_datasets_keep_their_cached_verdicts_side_by_side(tmp_path, monkeypatch):
    """The training and the validation set share ``data_check.json``: each passing verdict is kept, so
    a resume checks neither again (a stat() would fail the test)."""
    from mimo_sft.data import file_check
    from mimo_sft.data.sources import load_sft_dataset

    train = load_sft_dataset(DataConfig(dataset_path=str(_dataset(tmp_path, 20, set(), name="t.jsonl"))),
                             check_files=False)
    valid = load_sft_dataset(DataConfig(dataset_path=str(_dataset(tmp_path, 10, set(), name="v.jsonl"))),
                             check_files=False)
    run = tmp_path / "run"
    assert file_check.cached_check(train, run) is None and file_check.cached_check(valid, run) is None
    assert len(json.loads((run / "data_check.json").read_text())) == 2

    def no_stat(*a, **kw):
        raise AssertionError("a cached verdict was checked again")

    monkeypatch.setattr(file_check, "check_image_files", no_stat)
    assert file_check.cached_check(train, run) is None and file_check.cached_check(valid, run) is None


@pytest.mark.parametrize("threads", [1, 4])
def test_a_permission_error_is_not_read_as_a_missing_file(tmp_path, monkeypatch, threads):
    """Only "no such file" errnos count as missing (as ``Path.is_file``); another OSError is raised,
    and ``cached_check`` then lets the loader's own reads report it (an unknown layout counts as
    passing there)."""
    from mimo_sft.data import file_check
    from mimo_sft.data.sources import load_sft_dataset

    source = load_sft_dataset(DataConfig(dataset_path=str(_dataset(tmp_path, 30, set()))), check_files=False)
    real_stat, calls = os.stat, []

    def denied(path, *a, **kw):  # slow (so 4 threads take over after the first task), then refused
        calls.append(path)
        time.sleep(2e-4)
        if len(calls) > 7:
            raise PermissionError(13, "Permission denied", path)
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(file_check, "_TASK_PATHS", 7)

    monkeypatch.setattr(file_check.os, "stat", denied)
    with pytest.raises(PermissionError):
        file_check.check_image_files(source, threads=threads)


def _clip_rows(tmp_path, gone: dict[int, str], *, images_column: bool = False) -> list[dict]:
    """Messages rows naming a clip each (``clips/c.mp4``), a frame list at row 3, the rows in ``gone`` naming a
    file that does not exist instead (the clip, or for row 3 one of its frames); ``images_column``: every row's
    image in an ``images`` column (the clips stay in the content)."""
    from mimo_sft.testing.clips import write_clip

    (tmp_path / "clips").mkdir(exist_ok=True)
    write_clip(tmp_path / "clips" / "c.mp4", frames=4, width=32, height=32, fps=4)
    for j in range(2):
        Image.new("RGB", (16, 16)).save(tmp_path / "clips" / f"f{j}.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "page.png")
    rows = []
    for i in range(6):
        clip = gone.get(i, "clips/c.mp4")
        if i == 3:
            clip = ["clips/f0.png", gone.get(i, "clips/f1.png")]
        parts = [{"type": "video", "video": clip}, {"type": "text", "text": "?"}]
        row = {"messages": [{"role": "user", "content": parts},
                            {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
        if images_column:
            parts.insert(0, {"type": "image"})
            row["images"] = ["page.png"]
        rows.append(row)
    return rows


@pytest.mark.parametrize("layout", ["jsonl", "parquet_images_column", "sharegpt_video_column"])
def test_a_missing_clip_is_refused_before_step_0_as_a_missing_image_is(tmp_path, layout):
    """Issue 55 item 2: a missing clip file (or a missing frame of a frame list) was found only when its row was
    read, and skipped; the start-up check now stats clip files as it stats images, and names them in the same
    line: inline clip parts (JSON Lines, whose mixed file/frame-list parts datasets stores as JSON text), a
    parquet with an images column beside inline clips, and ShareGPT's ``video`` column."""
    import datasets

    from mimo_sft.data.sources import load_sft_dataset

    gone = {1: "clips/gone1.mp4", 3: "clips/gone3.png"}
    if layout == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in _clip_rows(tmp_path, gone)))
    elif layout == "parquet_images_column":
        rows = [r for r in _clip_rows(tmp_path, {1: "clips/gone1.mp4"}, images_column=True) if not
                isinstance(r["messages"][0]["content"][1]["video"], list)]  # one type per parquet column
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        gone = {1: "clips/gone1.mp4"}
    else:
        gone = {1: "clips/gone1.mp4"}
        rows = [{"conversations": [{"from": "human", "value": "<video>?"}, {"from": "gpt", "value": "a"}],
                 "video": gone.get(i, "clips/c.mp4")} for i in range(4)]
        _clip_rows(tmp_path, {})  # the files
        path = tmp_path / "d.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(dataset_path=str(path))
    source = load_sft_dataset(cfg, check_files=False)
    want = "; ".join(f"sample {i}: video file {tmp_path / f} not found" for i, f in sorted(gone.items()))
    assert _verdict(source, threads=1) == f"{want}; check the paths or set --image-root"
    with pytest.raises(UserError, match="video file .* not found"):
        load_sft_dataset(cfg)  # what finetune's start-up runs (train.feed.checked_source: the same check)
    assert type(source[0][1][-1]).__name__ == "VideoRef"  # (ShareGPT's video column is read: it was dropped)
    if layout == "jsonl":  # every file there: the check passes (frames, the clip file, nothing decoded)
        path.write_text("\n".join(json.dumps(r) for r in _clip_rows(tmp_path, {})))
        assert _verdict(load_sft_dataset(cfg, check_files=False), threads=1) is None
