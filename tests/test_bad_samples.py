"""Bad images at scale: the streamed, cached start-up file check, and ``--max-bad-samples`` stand-ins
that keep every rank's tokens identical (tests/test_reorder_index.py runs them through torchrun)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.config.schema import DataConfig
from mimo_sft.errors import UserError


def _rows(names):
    return [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": f"It is {n}."}]}],
             "images": [f"imgs/{n}.png"]} for n in names]


@pytest.fixture
def dataset(tmp_path):
    (tmp_path / "imgs").mkdir()
    for n, size in (("a", (90, 120)), ("b", (300, 200))):
        Image.new("RGB", size, (200, 30, 30)).save(tmp_path / "imgs" / f"{n}.png")
    (tmp_path / "imgs" / "junk.png").write_bytes(b"not an image at all")
    good = (tmp_path / "imgs" / "b.png").read_bytes()
    (tmp_path / "imgs" / "cut.png").write_bytes(good[: len(good) // 2])  # header reads, pixels do not
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(["a", "junk", "cut", "b"])))
    return path


def _iter(path, ckpt, *, need_pixels, max_bad=10, **kw):
    from mimo_sft.data.loader import build_microbatch_iterator

    cfg = DataConfig(dataset_path=str(path), seq_length=256, max_bad_samples=max_bad)
    return build_microbatch_iterator(cfg, model_dir=ckpt, micro_batch_size=4, canonical_grid=1, dp_size=1, dp_rank=0,
                                     need_pixels=need_pixels, seed=0, num_workers=kw.pop("num_workers", 0), **kw)


def test_stand_ins_keep_ranks_in_step(dataset, tiny_ckpt):
    pix, lang = _iter(dataset, tiny_ckpt, need_pixels=True), _iter(dataset, tiny_ckpt, need_pixels=False)
    a, b = next(pix), next(lang)
    for key in ("input_ids", "labels", "loss_mask", "position_ids", "sample_ids"):
        assert torch.equal(a[key], b[key]), key  # the encoder's and the language rank's views agree
    assert a["sample_ids"].tolist() == [0, 1, 2, 3]  # nothing replaced: the consumed count is unchanged
    # sample 1 (unreadable file): text-only, nothing supervised; the others keep their loss
    assert a["image_counts"].tolist() == [1, 0, 1, 1]
    assert float(a["loss_mask"][1].sum()) == 0.0 and all(float(a["loss_mask"][i].sum()) > 0 for i in (0, 2, 3))
    # sample 2 (pixels do not decode): same grid, zero pixels, so the encoder's patches match the text
    grids = a["image_grid_thw"].prod(-1).tolist()
    rows = torch.split(a["pixel_values"], grids)
    assert float(rows[1].abs().sum()) == 0.0 and float(rows[0].abs().sum()) > 0 and float(rows[2].abs().sum()) > 0
    assert sorted(pix.bad_samples) == [1, 2] and pix.bad_by_stage == {"header": 1, "pixels": 1, "row": 0}
    assert sorted(lang.bad_samples) == [1] and lang.images_decoded == 0  # language ranks never decode
    assert pix.images_decoded == 2  # a and b; the blank stand-in is not a decode


def test_over_the_limit_names_samples_and_files(dataset, tiny_ckpt):
    it = _iter(dataset, tiny_ckpt, need_pixels=True, max_bad=1, num_workers=1)
    with pytest.raises(UserError, match=r"2 samples could not be read, more than --max-bad-samples 1: "
                                        r"samples 1 \(.*junk.png\); 2 \(.*cut.png\)") as err:
        next(it)
    assert "\n" not in str(err.value)
    refuse = _iter(dataset, tiny_ckpt, need_pixels=False, max_bad=0)
    with pytest.raises(UserError, match=r"sample 1 \(.*junk.png\): cannot read image file"):
        next(refuse)


def test_file_deleted_mid_run_is_skipped(dataset, tiny_ckpt):
    from mimo_sft.data.loader import build_microbatch_iterator

    ok = dataset.parent / "ok.jsonl"
    ok.write_text("\n".join(json.dumps(r) for r in _rows(["a", "b", "a", "b"])))
    cfg = DataConfig(dataset_path=str(ok), seq_length=256, max_bad_samples=4)
    it = build_microbatch_iterator(cfg, model_dir=tiny_ckpt, micro_batch_size=2, canonical_grid=1, dp_size=1,
                                   dp_rank=0, need_pixels=True, seed=0, num_workers=0)  # the check passed here
    next(it)
    (dataset.parent / "imgs" / "b.png").unlink()
    batch = next(it)
    assert batch["image_counts"].tolist() == [1, 0] and sorted(it.bad_samples) == [3]
    assert "not found" in it.bad_samples[3][1]


def test_streamed_check_matches_whole_column_and_caches(tmp_path, monkeypatch):
    from mimo_sft.data import file_check
    from mimo_sft.data.sources import load_sft_dataset

    (tmp_path / "imgs").mkdir()
    names = [f"p{i}" for i in range(23)]
    for n in names:
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / f"{n}.png")
    rows = _rows(names)
    for i in (4, 5):
        rows[i]["images"] = rows[i]["images"] * 2  # multi-image rows: list parents cross slice bounds
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(dataset_path=str(path))
    source = load_sft_dataset(cfg, check_files=False)
    whole = list(file_check.image_paths(source))
    monkeypatch.setattr(file_check, "SLICE_ROWS", 3)
    assert list(file_check.image_paths(source)) == whole and len(whole) == 25
    assert [r for r, _ in whole[:7]] == [0, 1, 2, 3, 4, 4, 5]
    assert file_check.cached_check(source, tmp_path / "run") is None
    for n in names[:5]:
        (tmp_path / "imgs" / f"{n}.png").unlink()
    assert file_check.cached_check(source, tmp_path / "run") is None  # cached verdict: no file is stat()ed
    verdict = file_check.cached_check(source, None)
    assert verdict.startswith("sample 0: image file ") and "and 3 more" in verdict  # 6 missing: p0-p3, p4 twice
    with pytest.raises(UserError, match="sample 0: image file .*p0.png not found"):
        load_sft_dataset(cfg)


@pytest.mark.e2e
@pytest.mark.xdist_group("dist")
def test_a_corrupt_image_is_skipped_in_a_4_rank_run():
    """Sample 5's pixels do not decode (only the encoder rank that decodes it sees it) and sample 6's file is
    not an image (the language rank and the encoder rank that read it both see it): the run finishes, the step
    that holds them counts 2, and the log names each once with the run's count; no rank hangs (the same run
    with ``--max-bad-samples 0`` stops with one line: test_train_e2e's failing-rank test)."""
    from train_helpers import fixed_size_data, metrics, new_dir, tiny_model, torchrun

    out = new_dir("bad_sample_skipped")
    proc = torchrun(4, ["--hf-model", tiny_model(), "--dataset-path", fixed_size_data(16, broken_image=5, junk_image=6),
                        "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "4",
                        "--train-iters", "2", "--component", "language=dp=2", "--component",
                        "images=dp=2,rank_offset=2", "--scalable-dp", "--intra-microbatch-reorder",
                        "--num-workers", "0", "--no-tensorboard", "--output-dir", out], timeout=240)
    m = metrics(out)
    assert [r["bad_samples_skipped"] for r in m] == [0, 2], m
    assert [r["images_decoded"] for r in m] == [4, 2]  # the blank and text-only stand-ins are not decodes
    said = [ln for ln in proc.stderr.splitlines() if "skipped bad sample" in ln]
    assert len(said) == 2 and "skipped bad sample 5 (" in said[0] and "0005.png" in said[0], proc.stderr[-3000:]
    assert "skipped bad sample 6 (" in said[1] and said[1].endswith("; 2 skipped so far (--max-bad-samples 10)")


def test_worker_defaults_and_the_shm_warning():
    from mimo_sft.data.loader import resolve_num_workers, shm_warning

    assert resolve_num_workers(3) == 3  # asked for: kept
    assert resolve_num_workers(-1, cpus=16, local_ranks=8) == 1  # 2 cores per rank, one for training
    assert resolve_num_workers(-1, cpus=96, local_ranks=8) == 11 and resolve_num_workers(-1, cpus=2, local_ranks=4) == 0
    assert resolve_num_workers(-1, cpus=96, local_ranks=8, micro_batch_bytes=64 * 2**20, free_bytes=3 * 2**30) == 3
    mb = 6 * 2**20  # e.g. 2 pages of 1 Mpx as uint8
    assert shm_warning(4, micro_batch_bytes=mb, local_ranks=8, free_bytes=2**30) is None  # 384 MiB fit in 1 GiB
    line = shm_warning(4, micro_batch_bytes=mb, local_ranks=8, free_bytes=64 * 2**20)  # a container's default
    assert line.startswith("/dev/shm has 64 MiB free") and "384 MiB" in line and "--shm-size=1g" in line
    assert "\n" not in line and shm_warning(0, micro_batch_bytes=mb, free_bytes=0) is None


def test_a_bad_row_is_numbered_as_check_data_numbers_it(tmp_path, tiny_ckpt):
    """Issue 55 item 8: a mixture's second source has a row that names no clip; with --max-bad-samples 0 training
    refuses it by the mixture's index and its file's row, the line check-data prints for it."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.data.check import SampleProblem, check_dataset
    from mimo_sft.data.loader import build_microbatch_iterator

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "imgs" / "a.png")
    rows = _rows(["a"] * 4)
    (tmp_path / "first.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rows[1] = {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And?"}]},
                            {"role": "assistant", "content": [{"type": "text", "text": "A clip."}]}]}
    (tmp_path / "second.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(["--dataset-path", str(tmp_path / "first.jsonl"), "--dataset-path", str(tmp_path / "second.jsonl"),
                       "--seq-length", "256", "--max-bad-samples", "0"]).data
    (problem,) = check_dataset(cfg, model_dir=tiny_ckpt, workers=0)["problems"]
    listed = str(SampleProblem(**problem))
    assert listed.startswith(f"sample 5 ({tmp_path / 'second.jsonl'}, row 1): "), listed
    it = build_microbatch_iterator(cfg, model_dir=tiny_ckpt, micro_batch_size=8, canonical_grid=1, dp_size=1,
                                   dp_rank=0, need_pixels=True, seed=0, num_workers=0)
    with pytest.raises(UserError) as err:
        next(it)
    assert str(err.value) == listed


def count_over_ranks(rank: int, world: int, path: str, ckpt: str, scalable: bool, limit: int) -> dict:
    """One gloo rank: its shard of the first micro-batch of ``path`` (rows a, junk, cut, b), its decoding iterator
    handed to the run's tally, and the step's all-reduce of what it met first, as ``train.step_log`` does."""
    import logging

    import torch.distributed as dist

    from mimo_sft.data.loader import build_microbatch_iterator
    from mimo_sft.train.bad_samples import BadSampleTally

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("mimo_sft.data").addHandler(handler)
    cfg = DataConfig(dataset_path=path, seq_length=256, max_bad_samples=limit)
    it = build_microbatch_iterator(cfg, model_dir=ckpt, micro_batch_size=4, canonical_grid=world, dp_size=world,
                                   dp_rank=rank, need_pixels=True, seed=0, num_workers=0, scalable_dp=scalable)
    tally = BadSampleTally(it, limit=limit, group=None, announce=rank == 0)
    next(it)
    met = sorted(it.bad_samples)
    total = torch.tensor([tally.local_count()], dtype=torch.float64)
    dist.all_reduce(total)
    try:
        new, refused = tally.merge(float(total)), None
    except UserError as err:
        new, refused = None, str(err)
    return {"met": met, "new": new, "seen": sorted(tally.seen), "refused": refused, "lines": lines}


@pytest.mark.distributed
def test_bad_samples_are_counted_once_over_all_ranks(dataset, tiny_ckpt):
    """Issue 55 item 6, on two gloo ranks: each meets a different bad sample (its shard), or both meet sample 1
    (the micro-batch read whole); either way the run counts 2 distinct samples, says each once with the run's count,
    and past --max-bad-samples 1 every rank refuses in the same line -- which no rank alone would have reached."""
    from dist_utils import run_distributed

    split = run_distributed(count_over_ranks, 2, str(dataset), tiny_ckpt, True, 10)
    assert [r["met"] for r in split] == [[1], [2]]  # a different sample on each rank: "1 skipped so far" on both before
    assert [r["new"] for r in split] == [2, 2] and all(r["seen"] == [1, 2] for r in split)
    said = split[0]["lines"]
    assert len(said) == 2 and said[0].startswith("skipped bad sample 1 (") and said[1].startswith("skipped bad sample 2 (")
    assert said[1].endswith("; 2 skipped so far (--max-bad-samples 10)") and split[1]["lines"] == []
    whole = run_distributed(count_over_ranks, 2, str(dataset), tiny_ckpt, False, 10)
    # read whole, both ranks meet sample 1 (its file does not open; sample 2's pixels are decoded on rank 1 only)
    assert [r["met"] for r in whole] == [[1], [1, 2]] and [r["new"] for r in whole] == [2, 2]  # sample 1 once
    refused = run_distributed(count_over_ranks, 2, str(dataset), tiny_ckpt, True, 1)
    assert refused[0]["refused"] == refused[1]["refused"] and refused[0]["refused"].startswith(
        "2 samples could not be read, more than --max-bad-samples 1: samples 1 (")
