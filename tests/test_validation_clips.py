"""Clips in validation sets (issue 55 item 1), in one process: the start-up check plans a clip as a clip, the
validation reader's micro-batches equal what the training path builds for the same rows (frames, video tokens,
Qwen3-VL's timestamps, pixels, positions), and a validation row that cannot be evaluated is named as one, with
its file and row. Under torchrun: tests/test_video_e2e.py (the same validation set on three layouts, and
``mimo-sft evaluate``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import pytest
import torch

pytest.importorskip("torchvision")

from data_fixtures import _ROOT, tiny_checkpoint_dir  # noqa: E402
from mimo_sft.config.schema import DataConfig  # noqa: E402
from mimo_sft.errors import UserError  # noqa: E402

SEQ = 256
KEYS = ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids", "mm_token_type_ids", "image_counts",
        "sample_ids", "pixel_values", "image_grid_thw")


@functools.lru_cache(maxsize=None)
def clip_rows() -> str:
    """16 rows mixing clips (a window, a frame list, a variable-rate stream), pages and text (testing.clips)."""
    from mimo_sft.testing.clips import write_video_dataset

    return str(write_video_dataset(_ROOT / "valid_clips", samples=16, seed=3))


@functools.lru_cache(maxsize=None)
def checkpoint(family: str) -> str:
    if family == "qwen2_5_vl":
        return str(tiny_checkpoint_dir())
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(_ROOT / f"tiny_{family}_clips", family=family, vision_depth=2, text_layers=2))


def _training_batches(cfg, model, source, n_batches: int, mbs: int = 4) -> list[dict]:
    """The training path's first micro-batches over ``source`` in order (--dataloader-type single, one rank)."""
    from mimo_sft.data.loader import build_microbatch_iterator

    it = build_microbatch_iterator(dataclasses.replace(cfg, dataloader_type="single"), model_dir=model,
                                   micro_batch_size=mbs, canonical_grid=1, dp_size=1, dp_rank=0, need_pixels=True,
                                   seed=3, global_batch_size=mbs, num_workers=0, source=source)
    return [next(it) for _ in range(n_batches)]


def _validation_batches(cfg, model, source, n: int, mbs: int = 4, flag: str = "--valid-split") -> list[dict]:
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.validation import ValidationReader

    reader = ValidationReader(source, build_preprocessor(cfg, model), n_samples=n, micro_batch_size=mbs, dp_size=1,
                              dp_rank=0, need_pixels=True, scalable_dp=True, num_workers=0, pad_to_seq_length=True,
                              flag=flag)
    return list(reader)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("how", ["valid_split", "valid_dataset_path"])
def test_validation_micro_batches_with_clips_equal_the_training_path(family, how):
    """Before the fix the start-up check counted a clip as an image and refused the set ("the chat text has 0
    '<|image_pad|>' and 1 video placeholder(s) for 1 image(s)"); now the check passes with the tokens the
    reader supervises, and every field of every validation micro-batch is the training path's for those rows."""
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import check_validation_set, holdout_rows, split_sources

    model = checkpoint(family)
    if how == "valid_split":
        cfg = DataConfig(dataset_path=clip_rows(), seq_length=SEQ, valid_split="8")
        _train, valid = split_sources(cfg, seed=3, global_batch_size=4)
        rows = holdout_rows(16, 8, seed=3, min_train=4)[1]
    else:
        cfg = DataConfig(dataset_path="unused", valid_dataset_path=clip_rows(), seq_length=SEQ)
        _train, valid = split_sources(cfg, seed=3, global_batch_size=4)
        rows = list(range(8))
    pre = build_preprocessor(cfg, model)
    tokens = check_validation_set(valid, pre, 8, flag="--valid-split")
    got = _validation_batches(cfg, model, valid, 8)
    want = _training_batches(cfg, model, valid, 2)
    assert len(got) == 2
    for g, w in zip(got, want):
        for key in KEYS:
            assert torch.equal(g[key], w[key]), (family, how, key)
    assert sum(float(b["loss_mask"].sum()) for b in got) == tokens > 0
    assert sum(int((b["mm_token_type_ids"] == 2).sum()) for b in got) > 0  # video tokens, not image ones
    # and each validation sample is its row of the file, encoded as training encodes it
    full = load_sft_dataset(dataclasses.replace(cfg, dataset_path=clip_rows(), valid_split=None))
    for k, row in enumerate(rows):
        one = pre.encode(*full[row], row, need_pixels=False)
        b, r = divmod(k, 4)
        assert torch.equal(got[b]["input_ids"][r, : len(one["input_ids"])], one["input_ids"]), (k, row)
    if family == "qwen3_vl":  # the timestamps Qwen3-VL's processor writes before each temporal patch
        text = pre.tokenizer.decode(torch.cat([b["input_ids"].flatten() for b in got]).tolist())
        assert re.search(r"<\d+\.\d seconds>", text), text[:400]


def _rows_file(tmp_path, parts_of: dict[int, list], n: int = 8) -> str:
    rows = []
    for i in range(n):
        parts = parts_of.get(i, []) + [{"type": "text", "text": f"question {i}"}]
        rows.append({"messages": [{"role": "user", "content": parts},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_a_validation_row_that_cannot_be_read_is_named_as_one_with_its_file(tmp_path):
    """A clip whose header does not read (the start-up check) and an image whose pixels do not decode (the
    reader, at evaluation time): each line says it is a validation sample, names the set's flag, its file and row
    (for --valid-split: the row of the training file), and the clip or image file."""
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.validation import check_validation_set, holdout_rows, split_sources

    (tmp_path / "notaclip.mp4").write_text("hello")
    from PIL import Image

    Image.new("RGB", (64, 48), (200, 10, 10)).save(tmp_path / "page.png")
    blob = (tmp_path / "page.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(blob[: len(blob) // 2])  # the header reads, the pixels do not
    path = _rows_file(tmp_path, {5: [{"type": "video", "video": "notaclip.mp4"}],
                                 6: [{"type": "image", "image": "cut.png"}]})
    valid_rows = holdout_rows(8, 4, seed=1, min_train=1)[1]
    assert 5 in valid_rows and 6 in valid_rows, valid_rows  # (the seed's choice holds both rows out)
    cfg = DataConfig(dataset_path=path, seq_length=SEQ, valid_split="4")
    _train, valid = split_sources(cfg, seed=1, global_batch_size=1)
    pre = build_preprocessor(cfg, tiny_checkpoint_dir())
    k = valid_rows.index(5)
    with pytest.raises(UserError) as err:
        check_validation_set(valid, pre, 4, flag="--valid-split")
    line = str(err.value)
    assert line.startswith(f"--valid-split: validation sample {k} ({path}, row 5, {tmp_path / 'notaclip.mp4'}): "), line
    assert "placeholder" not in line and "\n" not in line

    clean = _rows_file(tmp_path, {6: [{"type": "image", "image": "cut.png"}]})
    cfg = DataConfig(dataset_path=clean, seq_length=SEQ, valid_split="4")
    _train, valid = split_sources(cfg, seed=1, global_batch_size=1)
    assert check_validation_set(valid, pre, 4, flag="--valid-split") > 0  # headers only: the cut file passes
    with pytest.raises(UserError) as err:
        _validation_batches(cfg, tiny_checkpoint_dir(), valid, 4, mbs=2)
    line = str(err.value)
    k = valid_rows.index(6)
    assert line.startswith(f"--valid-split: validation sample {k} ({clean}, row 6, {tmp_path / 'cut.png'}): "
                           "cannot decode image"), line
