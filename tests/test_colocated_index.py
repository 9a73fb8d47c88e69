"""Index-mode balancing on colocated layouts, in one process (the whole-read path stands in for each rank).

For every rank of a colocated layout (equal DP, fan-in over two gather groups, fan-out), its
micro-batch -- read by index, cut by ``data.colocated.ColocatedSplit`` -- is checked against an
independent reference: the whole decoded micro-batch permuted by the planner's order, with the
language fields of the rank's language slice and the pixels of its encoder slice. Every sample is
encoded by exactly one vision slice and computed by exactly one language slice, and the plan's
heaviest GPU is no heavier than the layout as read (lighter on this data). Under torchrun (the
gathered path, gradients against one process): tests/test_train_e2e.py.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from data_fixtures import demo_data, tiny_ckpt  # noqa: F401  (session fixtures)

MBS, STEPS = 8, 3


def _layout(*components):
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.layout import Layout

    return Layout.from_specs([parse_component(c) for c in components])


@pytest.mark.parametrize("components", [("language=dp=2", "images=dp=2"),
                                        ("language=tp=2,dp=2", "images=dp=4"),
                                        ("language=dp=4", "images=tp=2,dp=2")])
def test_each_rank_reads_its_slices_of_the_balanced_order(components, demo_data, tiny_ckpt):
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.colocated import PIXEL_KEYS, ColocatedSplit, colocated_read_plan, image_tokens_per_sample
    from mimo_sft.data.loader import build_microbatch_iterator, build_preprocessor, model_token_info
    from mimo_sft.data.reorder import make_patch_count_fn, permute_batch
    from mimo_sft.data.reorder.colocated_plan import ColocatedGrid, colocated_plan_info
    from mimo_sft.data.reorder.cost_model import make_real_token_fn
    from mimo_sft.data.reorder.serialize import merge_samples, split_samples
    from mimo_sft.data.sources import load_sft_dataset

    layout = _layout(*components)
    grid = ColocatedGrid.from_layout(layout)
    cfg = DataConfig(dataset_path=str(demo_data), seq_length=256, dataloader_type="cyclic")
    source, pre = load_sft_dataset(cfg), build_preprocessor(cfg, tiny_ckpt)
    info = model_token_info(tiny_ckpt)
    ids = dict(image_token_id=info["image_token_id"], merge_size=info["spatial_merge_size"])
    plan_fn = partial(colocated_plan_info, grid=grid, encoder_cost_weight=1.0, language_cost_weight=2.0,
                      stats_dp_sizes={"vision": grid.vision_dp})
    common = dict(model_dir=tiny_ckpt, micro_batch_size=MBS, canonical_grid=layout.canonical_grid, seed=3,
                  source=source, preprocessor=pre, num_workers=0)
    whole = build_microbatch_iterator(cfg, dp_size=1, dp_rank=0, need_pixels=True, **common)
    ranks = []
    for rank in range(layout.world_size):
        plan = colocated_read_plan(layout, rank, MBS)
        index = dict(n_groups=layout.canonical_grid, cost_fn=make_real_token_fn(), load_fn=make_patch_count_fn(**ids),
                     stats_dp_sizes={"vision": grid.vision_dp}, plan_fn=plan_fn, group=None)
        it = build_microbatch_iterator(cfg, dp_size=plan.dp_size, dp_rank=plan.dp_rank, need_pixels=True,
                                       pixel_slice=plan.encoder, index_reorder=index, **common)
        ranks.append((plan, it, ColocatedSplit.for_plan(plan, layout, image_token_id=ids["image_token_id"])))
    moved = False
    for _ in range(STEPS):
        full = whole.__next__()
        tokens = full["attention_mask"].sum(1).tolist()
        patches = make_patch_count_fn(**ids)(full)
        want = plan_fn(tokens, patches)
        moved |= want["order"] != list(range(MBS))
        records = split_samples(permute_batch(full, want["order"]))
        encoded, computed = [], []
        for plan, it, split in ranks:
            batch = split(next(it))
            assert it.last_stats["order"] == want["order"]
            shard = plan.dp_rank * (MBS // plan.dp_size)
            lang = range(shard + plan.language.start, shard + plan.language.stop)
            enc = range(shard + plan.encoder.start, shard + plan.encoder.stop)
            ref = merge_samples([{k: v for k, v in records[p].items() if k not in PIXEL_KEYS} for p in lang])
            for key, value in ref.items():
                assert torch.equal(batch[key], value), key
            ref_pixels = merge_samples([records[p] for p in enc])
            for key in PIXEL_KEYS:
                assert torch.equal(batch[key], ref_pixels[key]), key
            if "encoder_image_tokens" in batch:  # fan-in / fan-out: what the padded bridge cuts with
                enc_tokens = [int(image_tokens_per_sample(records[p], ids["image_token_id"])) for p in enc]
                assert batch["encoder_image_tokens"].tolist() == enc_tokens
            encoded += [int(records[p]["sample_ids"]) for p in enc]
            computed += batch["sample_ids"].tolist()
        # each sample encoded by one vision slice (its tp replicas repeat it) and computed by one
        # language slice (its tp ranks repeat it)
        vision_tp = layout.world_size // grid.vision_dp
        language_tp = layout.language.tp
        assert sorted(encoded) == sorted(full["sample_ids"].tolist() * vision_tp)
        assert sorted(computed) == sorted(full["sample_ids"].tolist() * language_tp)
        stats = ranks[0][1].last_stats
        assert max(stats["cost_after"]) <= max(stats["cost_before"])
    assert moved, "no micro-batch was rebalanced: the test proves nothing"
