"""``--reorder-mode index``: every rank plans the micro-batch from the costs of all its samples and
decodes only its own; the result is the exchange's, sample for sample and bit for bit.

Unit: each DP rank's share equals the exchange's result (the balanced order of the whole decoded
micro-batch, cut into rank slices: what ``exchange_window``'s merge builds), here on the whole-read
path (one process standing in for every rank: no group to gather the shard costs over); the
gathered path of training equals it on real gloo ranks in ``tests/test_index_costs.py``. End to end
(torchrun, the gathered path: the shard costs all-gathered on the reorder thread's group):
losses, gradient norms and every parameter's reduced gradient (``--save-grads``) are equal between
the two modes on an equal-DP layout (DP-1 modules, the exchange's local permutation, are the unit
test's ``dp=1`` case; every layout with reordering is also checked against a single process in
``test_train_e2e.py``, now in index mode by default; the index-mode run here is one of those).
"""

from __future__ import annotations

import pytest
import torch

from data_fixtures import demo_data, tiny_ckpt  # noqa: F401  (session fixtures)
from e2e_runs import GROUP_LAYOUTS
from mimo_sft.config.schema import DataConfig


def _iter(data, ckpt, **kw):
    from mimo_sft.data.loader import build_microbatch_iterator

    args = dict(model_dir=ckpt, micro_batch_size=8, canonical_grid=4, seed=3)
    args.update(kw)
    args.setdefault("num_workers", 0)
    return build_microbatch_iterator(DataConfig(dataset_path=str(data), seq_length=256), **args)


def test_each_rank_gets_the_exchange_share(demo_data, tiny_ckpt):
    from mimo_sft.data.reorder import make_cost_fn, make_patch_count_fn, permute_batch, window_plan
    from mimo_sft.data.reorder.serialize import merge_samples, split_samples

    from mimo_sft.data.loader import model_token_info

    info = model_token_info(tiny_ckpt)
    cost_fn = make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=0.5, image_token_id=info["image_token_id"],
                           merge_size=info["spatial_merge_size"])
    load_fn = make_patch_count_fn(image_token_id=info["image_token_id"], merge_size=info["spatial_merge_size"])
    for dp in (1, 2, 4):
        index = dict(n_groups=4, cost_fn=cost_fn, load_fn=load_fn, stats_dp_sizes={"vision": 2})
        ranks = [_iter(demo_data, tiny_ckpt, dp_size=dp, dp_rank=r, need_pixels=True, index_reorder=index)
                 for r in range(dp)]
        lang = _iter(demo_data, tiny_ckpt, dp_size=dp, dp_rank=dp - 1, need_pixels=False, index_reorder=index)
        whole = _iter(demo_data, tiny_ckpt, dp_size=1, dp_rank=0, need_pixels=True)
        moved = 0
        for _k in range(3):
            full = next(whole)
            order = window_plan.window_orders([cost_fn(full)], 4)[0]
            expect = split_samples(permute_batch(full, order))
            per = len(order) // dp
            got_lang = next(lang)
            for r, it in enumerate(ranks):
                got = next(it)
                want = merge_samples(expect[r * per:(r + 1) * per])
                assert set(got) == set(want)
                for key in want:
                    assert torch.equal(got[key], want[key]), (dp, r, key)
                assert it.last_stats["reorder_bytes"] == 0 and "vision_load_max_over_mean_after" in it.last_stats
                moved += sum(1 for i in order[r * per:(r + 1) * per] if not r * per <= i < (r + 1) * per)
            for key in ("input_ids", "labels", "loss_mask", "position_ids", "sample_ids"):  # language rank agrees
                assert torch.equal(got_lang[key], merge_samples(expect[(dp - 1) * per:])[key])
            assert "pixel_values" not in got_lang
        if dp > 1:
            assert moved > 0, "the demo data should need balancing (else this test proves nothing)"
        decoded = sum(it.images_decoded for it in ranks)
        assert decoded == whole.images_decoded  # each image decoded once, on its owner
    # in a DataLoader worker (the plan's functions travel with the forked dataset): the same batches
    inline, worker = (_iter(demo_data, tiny_ckpt, dp_size=2, dp_rank=1, need_pixels=True, index_reorder=index,
                            num_workers=n) for n in (0, 1))
    for _k in range(2):
        a, b = next(inline), next(worker)
        assert all(torch.equal(a[k], b[k]) for k in a) and inline.last_stats["order"] == worker.last_stats["order"]


@pytest.mark.e2e
@GROUP_LAYOUTS
def test_index_mode_equals_exchange_bit_for_bit():
    """The index-mode side is test_train_e2e's reordered equal-DP run (``e2e_runs.non_colocated_reordered``:
    padded rows, data read in the rank's process); the exchange side is that run in exchange mode,
    not overlapped: the exchange then decodes exactly the step's micro-batches (no window ahead).
    DP-1 modules (the exchange's local permutation): the unit test above."""
    from e2e_runs import NON_COLOCATED_4, REORDERED, layout_run, non_colocated_reordered
    from train_helpers import checkpoint_tensors, metrics

    runs = {"index": non_colocated_reordered(),
            "exchange": layout_run("reorder_exchange", 4, NON_COLOCATED_4,
                                   extra=[*REORDERED, "--reorder-mode", "exchange",
                                          "--no-overlap-intra-microbatch-reorder"])}
    a, b = metrics(runs["exchange"])[0], metrics(runs["index"])[0]
    for key in ("loss", "grad_norm", "supervised_tokens", "model_flops", "vision_load_max_over_mean_after"):
        assert a[key] == b[key], (key, a[key], b[key])
    assert b["reorder_bytes"] == 0  # no sample crosses ranks
    assert b["reorder_exchange_s"] > 0  # the shard costs were gathered (not every rank reading everything)
    assert a["reorder_bytes"] > 0
    assert a["images_decoded"] == b["images_decoded"] > 0  # each image decoded once, by one rank
    ga = checkpoint_tensors(runs["exchange"] + "/grads/iter_0000001")
    gb = checkpoint_tensors(runs["index"] + "/grads/iter_0000001")
    assert set(ga) == set(gb) and ga
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def test_plan_exchange_bytes_are_the_records_training_would_send(demo_data, tiny_ckpt):
    """``plan``'s exchange byte count = the serialized size of the real records that change rank."""
    from mimo_sft.data.loader import model_token_info
    from mimo_sft.data.reorder import make_cost_fn, window_plan
    from mimo_sft.data.reorder.serialize import record_meta, record_nbytes, split_samples
    from mimo_sft.plan.simulate import MicroBatchLoad, exchange_bytes

    info = model_token_info(tiny_ckpt)
    cost_fn = make_cost_fn(encoder_cost_weight=1.0, image_token_id=info["image_token_id"],
                           merge_size=info["spatial_merge_size"])
    vis_it = _iter(demo_data, tiny_ckpt, dp_size=1, dp_rank=0, need_pixels=True)
    text_it = _iter(demo_data, tiny_ckpt, dp_size=1, dp_rank=0, need_pixels=False)
    dp_sizes = {"images": 2, "language": 4}
    merge2 = info["spatial_merge_size"] ** 2
    total = 0
    for _k in range(4):
        vision, text = next(vis_it), next(text_it)
        order = window_plan.window_orders([cost_fn(vision)], 4)[0]
        recs = {"images": split_samples(vision), "language": split_samples(text)}
        want = 0
        for name, dp in dp_sizes.items():
            per = len(order) // dp
            want += sum(record_nbytes(record_meta(recs[name][i])) for k, i in enumerate(order) if k // per != i // per)
        mb = MicroBatchLoad(vision["sample_ids"].tolist(),
                            [float(merge2 * (r["input_ids"] == info["image_token_id"]).sum()) for r in recs["images"]],
                            [0.0] * len(order), vision["image_counts"].tolist())
        got = exchange_bytes([mb], [order], dp_sizes=dp_sizes, seq_length=256,
                             patch_bytes=vision["pixel_values"].shape[1])
        assert got == [float(want)]
        total += want
    assert total > 0, "some sample should move in 4 micro-batches (else this test proves nothing)"


def test_colocated_ranks_decode_only_their_encoder_slice(demo_data, tiny_ckpt):
    """Item 4: ranks reading the same shard (a bridge gather group) decode each image once between
    them, and each gets exactly its encoder slice's pixels (the split then needs no pixel cut)."""
    from mimo_sft.data.reorder.serialize import merge_samples, split_samples

    whole = _iter(demo_data, tiny_ckpt, dp_size=1, dp_rank=0, need_pixels=True)
    halves = [_iter(demo_data, tiny_ckpt, dp_size=1, dp_rank=0, need_pixels=True, pixel_slice=s)
              for s in (slice(0, 4), slice(4, 8))]
    for _k in range(3):
        full = next(whole)
        recs = split_samples(full)
        for s, it in zip((slice(0, 4), slice(4, 8)), halves):
            got = next(it)
            want = merge_samples([{k: r[k] for k in ("pixel_values", "image_grid_thw")} for r in recs[s]])
            assert torch.equal(got["pixel_values"], want["pixel_values"])
            assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
            assert torch.equal(got["input_ids"], full["input_ids"])  # every sample's text, as before
    assert sum(it.images_decoded for it in halves) == whole.images_decoded > 0
