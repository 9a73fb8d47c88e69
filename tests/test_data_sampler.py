"""Canonical-grid sampler: shards reassemble the global micro-batch; resume continues the stream."""

from __future__ import annotations

import math

import pytest

from mimo_sft.data.sampler import CanonicalSampler

DP_PAIRS = [(1, 1), (1, 2), (2, 2), (2, 3), (2, 4), (4, 4)]


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
@pytest.mark.parametrize("pair", DP_PAIRS)
def test_union_of_shards_is_global_micro_batch_on_both_modules(pair, dataloader_type):
    G = math.lcm(*pair)
    mbs = 2 * G
    total = 5 * mbs + 3  # several epochs with a remainder
    reference = CanonicalSampler(total, micro_batch_size=mbs, canonical_grid=G, dp_size=1, dp_rank=0,
                                 dataloader_type=dataloader_type, seed=7)
    steps = 3 * reference.micro_batches_per_epoch + 2
    expected = _take(iter(reference), steps)
    assert all(len(mb) == mbs for mb in expected)
    for d in pair:
        shards = [_take(iter(CanonicalSampler(total, micro_batch_size=mbs, canonical_grid=G, dp_size=d, dp_rank=r,
                                              dataloader_type=dataloader_type, seed=7)), steps) for r in range(d)]
        for k in range(steps):
            assert all(len(s[k]) == mbs // d for s in shards)
            assert sum((s[k] for s in shards), []) == expected[k], (d, k)
    # canonical groups of rank r cover [r*G/d, (r+1)*G/d)
    for d in pair:
        groups = [list(CanonicalSampler(total, micro_batch_size=mbs, canonical_grid=G, dp_size=d, dp_rank=r).canonical_groups())
                  for r in range(d)]
        assert sum(groups, []) == list(range(G))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_resume_equals_continuous_across_epochs(dataloader_type, drop_last):
    kw = dict(micro_batch_size=4, canonical_grid=2, dp_size=2, dp_rank=1, dataloader_type=dataloader_type,
              drop_last=drop_last, seed=3)
    total = 10
    continuous = _take(iter(CanonicalSampler(total, **kw)), 12)
    for consumed_mb in (1, 2, 3, 5, 7):  # 2 or 3 micro-batches per epoch: several resumes land past a boundary
        resumed = _take(iter(CanonicalSampler(total, consumed_samples=consumed_mb * 4, **kw)), 12 - consumed_mb)
        assert resumed == continuous[consumed_mb:], consumed_mb


def test_single_reads_in_order_and_drop_last():
    s = CanonicalSampler(10, micro_batch_size=4, canonical_grid=1, dp_size=1, dp_rank=0, drop_last=True)
    assert _take(iter(s), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    s = CanonicalSampler(10, micro_batch_size=4, canonical_grid=1, dp_size=1, dp_rank=0, drop_last=False)
    assert _take(iter(s), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [0, 1, 2, 3]]


def test_cyclic_reshuffles_each_epoch_deterministically():
    kw = dict(micro_batch_size=8, canonical_grid=1, dp_size=1, dp_rank=0, dataloader_type="cyclic")
    a = CanonicalSampler(16, seed=5, **kw)
    b = CanonicalSampler(16, seed=5, **kw)
    c = CanonicalSampler(16, seed=6, **kw)
    ea, eb, ec = _take(iter(a), 4), _take(iter(b), 4), _take(iter(c), 4)
    assert ea == eb
    assert ea != ec
    assert sorted(ea[0] + ea[1]) == list(range(16)) and sorted(ea[2] + ea[3]) == list(range(16))
    assert ea[0] + ea[1] != ea[2] + ea[3]  # a new permutation in epoch 1
    assert a.epoch_order(1).tolist() == CanonicalSampler(16, seed=5, **kw).epoch_order(1).tolist()


def test_whole_micro_batch_mode_reads_everything():
    s = CanonicalSampler(8, micro_batch_size=4, canonical_grid=2, dp_size=2, dp_rank=1, whole_micro_batch=True)
    assert next(iter(s)) == [0, 1, 2, 3]
    assert s.slice == (2, 4)


def test_resume_must_be_micro_batch_aligned():
    with pytest.raises(AssertionError):
        CanonicalSampler(8, micro_batch_size=4, canonical_grid=1, dp_size=1, dp_rank=0, consumed_samples=3)
