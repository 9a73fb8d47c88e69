"""Pure serialization: per-sample split/merge, byte round trips, local permutation."""

from __future__ import annotations

import pytest
import torch

from mimo_sft.data.reorder import serialize
from tests.reorder_helpers import PIX_DIM, assert_batch_intact, make_batch, make_sample


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]
)
def test_round_trip_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    recs = []
    for n in (0, 1, 5, 3):  # odd sizes exercise the alignment padding; 0 rows a text-only sample
        if dtype == torch.bool:
            t = torch.rand(n, 3, generator=g) > 0.5
        elif dtype.is_floating_point:
            t = torch.randn(n, 3, generator=g).to(dtype)
        else:
            t = torch.randint(0, 100, (n, 3), generator=g).to(dtype)
        recs.append({"x": t, "position_ids": torch.randint(0, 99, (3, 1, 7), generator=g)})
    metas = [serialize.record_meta(r) for r in recs]
    buf = serialize.serialize_records(recs)
    assert buf.dtype == torch.uint8 and buf.numel() == sum(serialize.record_nbytes(m) for m in metas)
    assert buf.numel() % serialize.ALIGN == 0
    back, end = serialize.deserialize_records(buf, metas)
    assert end == buf.numel()
    for a, b in zip(recs, back):
        _equal(a, b)


def test_unsupported_dtype_and_short_buffer_are_errors():
    with pytest.raises(ValueError, match="float64"):
        serialize.record_meta({"x": torch.zeros(1, dtype=torch.float64)})
    rec = {"x": torch.arange(4)}
    meta = serialize.record_meta(rec)
    buf = serialize.serialize_records([rec])
    with pytest.raises(RuntimeError, match="bytes"):
        serialize.deserialize_records(buf[:-8], [meta])


def test_split_merge_round_trip_with_0_to_2_images_and_mrope():
    ids = list(range(30))
    batch = make_batch(ids, with_pixels=True)
    counts = batch["image_counts"].tolist()
    assert 0 in counts and 2 in counts and 1 in counts  # the fixture covers 0..N images
    recs = serialize.split_samples(batch)
    assert len(recs) == 30
    for rec in recs:
        assert rec["position_ids"].shape == (3, 1, batch["position_ids"].shape[2])
        assert rec["pixel_values"].shape[1] == PIX_DIM  # text-only: zero rows, same width
        assert rec["image_grid_thw"].shape[0] == int(rec["image_counts"][0])
    _equal(serialize.merge_samples(recs), batch)
    assert_batch_intact(batch, with_pixels=True)


def test_bytes_round_trip_whole_batch_then_merge():
    batch = make_batch(range(100, 110), with_pixels=True)
    recs = serialize.split_samples(batch)
    metas = [serialize.record_meta(r) for r in recs]
    back, _ = serialize.deserialize_records(serialize.serialize_records(recs), metas)
    _equal(serialize.merge_samples(back), batch)


def test_batches_without_any_image():
    """Vision rank, every sample text-only: pixel_values is [0, D] and survives split/merge/permute."""
    batch = make_batch(range(5, 9), with_pixels=True, text_only=True)
    assert batch["pixel_values"].shape == (0, PIX_DIM) and batch["image_grid_thw"].shape == (0, 3)
    merged = serialize.merge_samples(serialize.split_samples(batch)[::-1])
    assert merged["pixel_values"].shape == (0, PIX_DIM) and merged["pixel_values"].dtype == torch.float32
    assert merged["sample_ids"].tolist() == [8, 7, 6, 5]


def test_permute_batch_matches_split_merge_and_moves_pixel_rows_with_samples():
    for pixels in (True, False):
        batch = make_batch(range(200, 212), with_pixels=pixels)
        order = [5, 0, 11, 3, 2, 7, 1, 10, 4, 9, 6, 8]
        fast = serialize.permute_batch(batch, order)
        recs = serialize.split_samples(batch)
        _equal(fast, serialize.merge_samples([recs[i] for i in order]))
        assert fast["sample_ids"].tolist() == [200 + i for i in order]
        assert_batch_intact(fast, with_pixels=pixels)
    ident = make_batch(range(3), with_pixels=True)
    assert serialize.permute_batch(ident, [0, 1, 2])["pixel_values"] is ident["pixel_values"]
    with pytest.raises(ValueError):
        serialize.permute_batch(ident, [0, 0, 1])


def test_inconsistent_image_metadata_is_caught():
    batch = make_batch([1, 2, 3, 4, 5, 6], with_pixels=True)
    bad = dict(batch)
    bad["pixel_values"] = batch["pixel_values"][:-1]
    with pytest.raises(ValueError, match="patch rows"):
        serialize.split_samples(bad)
    bad = dict(batch)
    bad["image_counts"] = batch["image_counts"] + 1
    with pytest.raises(ValueError, match="image_counts"):
        serialize.split_samples(bad)


def test_single_sample_helper_shapes():
    s = make_sample(3, with_pixels=False)
    assert s["position_ids"].shape[:2] == (3, 1) and "pixel_values" not in s
