"""End-to-end iterator: shards of two modules with different DP sizes reassemble the same global
micro-batch (pixels on one module, metadata-only on the other); resume continues the stream."""

from __future__ import annotations

import math

import pytest
import torch

from data_fixtures import demo_data, tiny_ckpt  # noqa: F401  (session fixtures)
from mimo_sft.config.schema import DataConfig

KEYS = ("input_ids", "labels", "loss_mask", "attention_mask", "mm_token_type_ids", "sample_ids", "image_counts")


@pytest.fixture(scope="module")
def shared(tiny_ckpt, demo_data):
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset

    cfg = DataConfig(dataset_path=str(demo_data), seq_length=160, dataloader_type="cyclic")
    return cfg, load_sft_dataset(cfg), build_preprocessor(cfg, tiny_ckpt)


def _it(shared, ckpt, **kw):
    from mimo_sft.data.loader import build_microbatch_iterator

    cfg, source, pre = shared
    return build_microbatch_iterator(cfg, model_dir=ckpt, seed=4, source=source, preprocessor=pre, **kw)


@pytest.mark.parametrize("pair", [(1, 2), (2, 3), (2, 4)])
def test_modules_with_different_dp_see_the_same_global_micro_batch(shared, tiny_ckpt, pair):
    G = math.lcm(*pair)
    mbs = G if G >= 4 else 2 * G
    per_module = []
    for m, d in enumerate(pair):
        its = [_it(shared, tiny_ckpt, micro_batch_size=mbs, canonical_grid=G, dp_size=d, dp_rank=r,
                   need_pixels=(m == 0)) for r in range(d)]
        steps = []
        for _ in range(3):
            parts = [next(i) for i in its]
            steps.append({k: torch.cat([p[k] for p in parts], 0) for k in KEYS}
                         | {"position_ids": torch.cat([p["position_ids"] for p in parts], 1)})
            if m == 0:
                n_img_tokens = sum(int(p["image_grid_thw"].prod(-1).sum()) if "image_grid_thw" in p else 0 for p in parts)
                assert n_img_tokens // 4 == int(steps[-1]["mm_token_type_ids"].sum())
        per_module.append(steps)
    for a, b in zip(*per_module):
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert len(set(a["sample_ids"].tolist())) == mbs


def test_resume_equals_continuous_across_epoch_boundary(shared, tiny_ckpt):
    cfg, source, pre = shared
    kw = dict(micro_batch_size=4, canonical_grid=2, dp_size=2, dp_rank=1, need_pixels=False)
    per_epoch = len(source) // 4
    cont = _it(shared, tiny_ckpt, **kw)
    stream = [next(cont)["sample_ids"].tolist() for _ in range(per_epoch + 2)]
    resumed = _it(shared, tiny_ckpt, consumed_samples=(per_epoch - 1) * 4, **kw)
    assert [next(resumed)["sample_ids"].tolist() for _ in range(3)] == stream[per_epoch - 1:]


def test_workers_give_the_same_stream(shared, tiny_ckpt):
    kw = dict(micro_batch_size=4, canonical_grid=1, dp_size=1, dp_rank=0, need_pixels=True)
    a, b = _it(shared, tiny_ckpt, **kw), _it(shared, tiny_ckpt, num_workers=2, **kw)
    for _ in range(4):
        x, y = next(a), next(b)
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
