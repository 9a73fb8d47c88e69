"""Streamed sources (parquet shards and WebDataset tars read in place): the same samples as the same
rows loaded through ``datasets``, no Arrow copy, positions for the checkpoint, and one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.config.schema import DataConfig
from mimo_sft.data.mixture import MixtureSource
from mimo_sft.data.sources import load_sft_dataset
from mimo_sft.data.streamed import StreamedSource, check_resumed_streams, stream_position
from mimo_sft.errors import UserError
from mimo_sft.testing.demo_data import demo_rows, write_demo_dataset, write_shards

N = 90


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The demo's rows (text-only, multi-image, large pages, long answers) as one parquet loaded by
    ``datasets`` and as parquet shards (row groups of 8) and tar shards holding the same rows."""
    root = tmp_path_factory.mktemp("streamed")
    rows = demo_rows(N, seed=5, long_answers=True)
    write_demo_dataset(root / "full.parquet", samples=N, seed=5, long_answers=True)
    write_shards(rows, root / "pq", shards=4, row_group_rows=8)
    write_shards(rows, root / "wds", shards=3, kind="webdataset")
    kinds = {"text": sum(not r["images"] for r in rows), "multi": sum(len(r["images"]) > 1 for r in rows)}
    assert kinds["text"] > 0 and kinds["multi"] > 0, kinds
    return root


def _cfg(path, **kw) -> DataConfig:
    return DataConfig(dataset_path=None if path is None else str(path), **kw)


@pytest.mark.parametrize("kind", ["pq", "wds"])
def test_streamed_rows_are_the_datasets_rows(data, kind):
    ref = load_sft_dataset(_cfg(data / "full.parquet"))
    got = load_sft_dataset(_cfg(data / kind, streaming=kind == "pq"))  # tars are streamed without the flag
    assert isinstance(got, StreamedSource) and len(got) == len(ref) == N
    # out of order too: a rank's reads jump between row groups and shards
    for i in [*range(N), 77, 3, 41, 89, 0]:
        assert got[i] == ref[i], i


def test_parquet_glob_and_split_naming(data):
    glob_src = load_sft_dataset(_cfg(f"{data}/pq/train-0000[0-1]-*.parquet", streaming=True))
    assert len(glob_src) == N // 2
    with pytest.raises(UserError, match="'valid': .* has the split\\(s\\) train .*pick one of those"):
        load_sft_dataset(_cfg(data / "pq", streaming=True, split="valid"))


#: folders as users lay them out: each split rule datasets applies to a folder (names relative to it)
SPLIT_LAYOUTS = {
    "prefix": ["train-00000.parquet", "valid-00000.parquet"],
    "sharded": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                "data/validation-00000-of-00001.parquet"],
    "folders": ["train/a.parquet", "train/b.parquet", "dev/c.parquet", "test/d.parquet"],
    "infix": ["docs-train-0.parquet", "docs-test-0.parquet", "docs-val-0.parquet", "docs-train-1.parquet"],
    "aliases": ["training/x.parquet", "evaluation/y.parquet", "validation/z.parquet"],
    "no_split_names": ["a.parquet", "sub/b.parquet"],
}


@pytest.mark.parametrize("layout", sorted(SPLIT_LAYOUTS))
def test_streamed_and_loaded_folders_read_the_same_files_for_every_split(data, layout, tmp_path):
    """Issue 42: a streamed folder picks, for every split, exactly the files ``datasets`` loads for it (its
    own folder resolution is the reference), so --streaming never trains on a folder's validation shards."""
    import shutil

    import datasets

    from mimo_sft.data.shards import find_shards

    shards = sorted((data / "pq").glob("*.parquet"))
    folder = tmp_path / layout
    for i, name in enumerate(SPLIT_LAYOUTS[layout]):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shards[i % len(shards)], folder / name)
    expected = datasets.load_dataset_builder(str(folder)).config.data_files
    assert set(expected) >= {"train"}
    for split, files in expected.items():
        assert [str(f) for f in find_shards(str(folder), split=str(split))[1]] == sorted(files), (layout, split)
        streamed = load_sft_dataset(_cfg(folder, streaming=True, split=str(split)))
        loaded = load_sft_dataset(_cfg(folder, split=str(split)))
        assert len(streamed) == len(loaded), (layout, split)
        assert [streamed[i] == loaded[i] for i in (0, len(loaded) - 1)] == [True, True], (layout, split)


def test_no_arrow_copy_is_written(data, tmp_path, monkeypatch):
    """Opening shards reads metadata only: datasets' cache gains no Arrow file."""
    import datasets

    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    src = load_sft_dataset(_cfg(data / "pq", streaming=True))
    src[5]
    wds = load_sft_dataset(_cfg(data / "wds"))
    wds[5]
    written = sorted(p.relative_to(cache).parts[0] for p in cache.rglob("*") if p.is_file()) if cache.exists() else []
    assert set(written) <= {"mimo_sft_tar_index"}, written  # the tar member index, nothing else
    assert not [p for p in cache.rglob("*.arrow")]


def test_tar_index_is_cached_and_rebuilt_when_a_shard_changes(data, tmp_path, monkeypatch):
    import datasets

    from mimo_sft.data import shards

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "c")
    shard = tmp_path / "one.tar"
    shard.write_bytes((data / "wds" / "shard-000000.tar").read_bytes())
    first = shards.cached_tar_index(str(shard))
    cached = sorted((tmp_path / "c" / "mimo_sft_tar_index").glob("*.npy"))
    assert len(cached) == 2  # samples and images
    again = shards.cached_tar_index(str(shard))
    assert isinstance(again["samples"], np.memmap)  # read from the cache, shared through the page cache
    assert all((np.asarray(first[k]) == np.asarray(again[k])).all() for k in first)
    rows = demo_rows(4, seed=9)
    write_shards(rows, tmp_path / "new", shards=1, kind="webdataset")
    shard.write_bytes((tmp_path / "new" / "shard-000000.tar").read_bytes())
    os.utime(shard, ns=(1, 1))
    assert len(shards.cached_tar_index(str(shard))["samples"]) == 4 + 1
    assert all(c.exists() for c in cached) and len(list(cached[0].parent.glob("*.npy"))) == 4


def test_a_mixture_with_a_streamed_source(data):
    docs = load_sft_dataset(_cfg(data / "full.parquet"))
    mix = load_sft_dataset(dataclasses.replace(_cfg(None), datasets=[
        {"path": str(data / "full.parquet"), "weight": 0.6, "name": "docs"},
        {"path": str(data / "wds"), "weight": 0.4, "name": "web"}]))
    assert isinstance(mix, MixtureSource) and isinstance(mix.parts[1], StreamedSource)
    order = mix.order(seed=3, shuffle=False)
    for idx in order.indices(0, 200):
        s, row = mix.locate(idx)
        assert mix[idx] == docs[row]  # both sources hold the same rows
    pos = stream_position(mix, 200, seed=3, micro_batch_size=8, drop_last=True)
    web = pos["web"]
    assert list(pos) == ["web"] and web["draws"] == order.draws_before(200)[1]
    assert web["epoch"] == web["draws"] // N and web["next_row"] == web["draws"] % N
    lo = sum(n for _name, n in web["shards"][:[s[0] for s in web["shards"]].index(web["shard"])])
    assert lo + web["row_in_shard"] == web["next_row"]


def test_one_streamed_source_position_and_resume_check(data):
    src = load_sft_dataset(_cfg(data / "pq", streaming=True))
    pos = stream_position(src, 88, seed=0, micro_batch_size=8, drop_last=True)["dataset"]
    # 90 rows, micro-batches of 8 with drop_last: 88 positions an epoch, so position 88 is epoch 1, row 0
    assert (pos["epoch"], pos["next_row"], pos["shard"], pos["row_in_shard"]) == (1, 0, "train-00000-of-00004.parquet", 0)
    pos = stream_position(src, 40, seed=0, micro_batch_size=8, drop_last=True)["dataset"]
    assert (pos["shard"], pos["row_in_shard"]) == ("train-00001-of-00004.parquet", 18)
    saved = {"dataset": pos}
    check_resumed_streams(saved, {"dataset": pos}, checkpoint="ck")
    moved = dict(pos, shards=[[n, r] for n, r in pos["shards"][:-1]])
    with pytest.raises(UserError, match="the shards of streamed source 'dataset' differ"):
        check_resumed_streams(saved, {"dataset": moved}, checkpoint="ck")


@pytest.mark.parametrize("setting,match", [
    ({"dataloader_type": "cyclic"}, "is streamed \\(shards read in order\\): --dataloader-type cyclic"),
    ({"valid_split": "0.1"}, "is streamed: --valid-split holds out random rows"),
])
def test_random_access_modes_are_refused_naming_the_source(data, setting, match):
    with pytest.raises(UserError, match=match):
        load_sft_dataset(_cfg(data / "wds", **setting))
    from mimo_sft.config.checks.data import c17_data

    class Ctx:
        for_run = True
        cfg = type("C", (), {"data": dataclasses.replace(_cfg(None), datasets=[
            {"path": str(data / "full.parquet"), "name": "docs"},
            {"path": str(data / "pq"), "name": "shards", "streaming": True}], **setting)})()

    lines = [x for x in c17_data(Ctx()) if isinstance(x, str)]
    assert len(lines) == 1 and lines[0].startswith("source 'shards' is streamed"), lines


def _tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def test_bad_shards_get_one_line(data, tmp_path):
    _tar(tmp_path / "gz.tar.gz", [("a.json", b"{}")], mode="w:gz")
    with pytest.raises(UserError, match="is a compressed tar; .* plain .tar shards"):
        load_sft_dataset(_cfg(tmp_path / "gz.tar.gz", streaming=True))
    (tmp_path / "nojson").mkdir()
    _tar(tmp_path / "nojson" / "s.tar", [("k1.png", b"x")])
    with pytest.raises(UserError, match="sample 'k1' has no .json member \\(it has png\\)"):
        load_sft_dataset(_cfg(tmp_path / "nojson"))
    (tmp_path / "mixed").mkdir()
    for f in ("a.parquet", "b.tar"):
        (tmp_path / "mixed" / f).write_bytes((data / "wds" / "shard-000000.tar").read_bytes())
    with pytest.raises(UserError, match="holds both parquet and tar shards"):
        load_sft_dataset(_cfg(tmp_path / "mixed", streaming=True))
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "cols").mkdir()
    pq.write_table(pa.table({"messages": ["x"]}), tmp_path / "cols" / "a.parquet")
    pq.write_table(pa.table({"conversations": ["x"]}), tmp_path / "cols" / "b.parquet")
    with pytest.raises(UserError, match="every shard of a source needs the same columns"):
        load_sft_dataset(_cfg(tmp_path / "cols", streaming=True))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .parquet or .tar shards found"):
        load_sft_dataset(_cfg(tmp_path / "empty", streaming=True))


def test_validate_refuses_random_access_on_a_streamed_source_before_any_process(data):
    from typer.testing import CliRunner

    from mimo_sft.cli import app

    res = CliRunner().invoke(app, ["validate", "--dataset-path", str(data / "pq"), "--streaming",
                                   "--dataloader-type", "cyclic", "--valid-split", "0.1"])
    assert res.exit_code == 2, res.output
    cyclic = f"[17] --dataset-path {data / 'pq'} is streamed (shards read in order): --dataloader-type cyclic"
    assert res.output.count(cyclic) == 1, res.output  # check 17's line, not again from opening the shards
    assert "or drop --streaming to load it through datasets" in res.output
    assert res.output.count("--valid-split holds out random rows of it") == 1 and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["validate", "--dataset-path", str(data / "wds"), "--dataloader-type", "cyclic"])
    assert res.exit_code == 2 and "is streamed (shards read in order)" in res.output
    assert "drop --streaming" not in res.output  # tars are streamed without the flag


def test_decoding_workers_read_a_streamed_mixture_as_the_loaded_one(data, tiny_ckpt):  # noqa: F811
    """Two DataLoader workers per iterator over parquet shards and tars (their open files and row-group
    caches forked into the workers) give the micro-batches of the loaded rows, pixels included."""
    import torch

    from mimo_sft.data.loader import build_microbatch_iterator, build_preprocessor

    def batches(paths, streaming, workers):
        cfg = dataclasses.replace(_cfg(None), seq_length=160, streaming=streaming, datasets=[
            {"path": str(p), "name": n} for n, p in zip(("a", "b"), paths)])
        it = build_microbatch_iterator(cfg, model_dir=tiny_ckpt, micro_batch_size=8, canonical_grid=2, dp_size=2,
                                       dp_rank=1, need_pixels=True, seed=2, num_workers=workers,
                                       preprocessor=build_preprocessor(cfg, tiny_ckpt))
        out = [next(it) for _ in range(6)]
        it.shutdown() if hasattr(it, "shutdown") else None
        return out

    loaded = batches([data / "full.parquet", data / "full.parquet"], False, 0)
    streamed = batches([data / "pq", data / "wds"], True, 2)
    for a, b in zip(loaded, streamed):
        for key in ("input_ids", "labels", "sample_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(a[key], b[key]), key


def _tar_samples(path, samples: list[tuple[str, dict, list[bytes]]]) -> None:
    """A WebDataset shard: per sample ``<key>.json`` and ``<key>.<i>.png`` image members."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for key, obj, images in samples:
            members = [(f"{key}.json", json.dumps(obj).encode())] + [(f"{key}.{i}.png", b) for i, b in enumerate(images)]
            for name, blob in members:
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))


def test_bad_rows_are_skipped_counted_and_named_by_shard_and_row(tmp_path, tiny_ckpt):
    """Issue 42 item 2: a video part that names no clip, an image part without its member and a path that is
    not there are known from the row; each is skipped (the next row stands in), counted against --max-bad-samples, and named by
    shard and row in words that fit a tar; with --max-bad-samples 0 the first stops the run in one line."""
    from PIL import Image

    from mimo_sft.data.loader import build_microbatch_iterator

    png = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(png, format="PNG")
    png = png.getvalue()

    def row(user, images=None):
        obj = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "a red square"}]}
        return {**obj, **({"images": images} if images else {})}

    image_q = [{"type": "image"}, {"type": "text", "text": "what is it?"}]
    _tar_samples(tmp_path / "shard-00000.tar", [
        ("k0", row(image_q), [png]),
        ("k1", row(image_q), []),                                        # its image member is missing
        ("k2", row([{"type": "video"}, {"type": "text", "text": "and this?"}]), []),  # a clip part naming no clip
        ("k3", row(image_q, ["missing.png"]), []),                       # a path that is not there
        ("k4", row("just text"), []), ("k5", row(image_q), [png]), ("k6", row("more text"), []),
        ("k7", row(image_q), [png])])

    def it(max_bad):
        cfg = DataConfig(dataset_path=str(tmp_path / "shard-00000.tar"), seq_length=256, max_bad_samples=max_bad)
        return build_microbatch_iterator(cfg, model_dir=tiny_ckpt, micro_batch_size=4, canonical_grid=1, dp_size=1,
                                         dp_rank=0, need_pixels=True, seed=0, num_workers=0)

    served = it(10)
    batch = next(served)
    assert sorted(served.bad_samples) == [1, 2, 3], served.bad_samples
    assert served.bad_by_stage["row"] == 2 and served.bad_by_stage["header"] == 1
    (where1, why1), (where2, why2), (where3, why3) = (served.bad_samples[i] for i in (1, 2, 3))
    assert where1.endswith("shard-00000.tar, row 1") and "image member(s)" in why1 and "column" not in why1
    assert where2.endswith("shard-00000.tar, row 2") and "1 video part" in why2 and "0 clip(s) named" in why2
    assert where3.endswith("missing.png") and "image file not found" in why3 and "column" not in why3
    # rows 1 and 2 stand in with the next row that reads (3, itself text-only: its file is not there)
    assert batch["sample_ids"].tolist() == [0, 3, 3, 3], batch["sample_ids"]
    with pytest.raises(UserError) as err:
        next(it(0))
    assert "\n" not in str(err.value) and "shard-00000.tar, row 1" in str(err.value)
