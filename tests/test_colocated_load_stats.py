"""data/colocated.py and data/load_stats.py: the colocated read plan and split (pure), the step's
vision-load figures (pure without a group), and the once-per-step all-gather on 2 gloo ranks giving
what a per-micro-batch gather gave."""

import pytest
import torch

from dist_utils import run_distributed
from reorder_helpers import IMAGE_TOKEN_ID, MERGE, encoder_slice_pixels, make_batch

from mimo_sft.data.colocated import ColocatedSplit, colocated_read_plan, image_tokens_per_sample
from mimo_sft.data.load_stats import VisionLoadStats, vision_load_spread
from mimo_sft.data.reorder import load_spread, make_patch_count_fn, rank_loads
from mimo_sft.parallel.components import parse_component
from mimo_sft.parallel.layout import Layout

PATCHES = make_patch_count_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)


def _spread(costs, n_groups, dp):
    return load_spread(rank_loads(costs, n_groups, dp))["max_over_mean"]


def test_step_figures_are_the_mean_of_per_micro_batch_spreads():
    stats = VisionLoadStats(patch_fn=PATCHES, n_groups=4, vision_dp=2)
    batches = [make_batch(range(4 * k, 4 * k + 4), with_pixels=False) for k in range(3)]
    for b in batches:
        stats.record(b)
    want = [_spread(PATCHES(b), 4, 2) for b in batches]
    assert len(set(want)) > 1  # the micro-batches really differ
    assert stats.step_figures() == (sum(want) / len(want), None)
    stats.start_step()
    assert stats.step_figures() == (None, None)
    assert vision_load_spread([1.0, 2.0, 3.0], 2, 2) is None  # does not split over 2 ranks


def test_reordered_figures_pass_through_and_a_disabled_rank_keeps_nothing():
    stats = VisionLoadStats(patch_fn=PATCHES, n_groups=2, vision_dp=2)
    for before, after in ((1.5, 1.1), (1.25, 1.0)):
        stats.record_reordered({"vision_load_max_over_mean_before": before, "vision_load_max_over_mean_after": after})
    assert stats.step_figures() == ((1.5 + 1.25) / 2, (1.1 + 1.0) / 2)
    off = VisionLoadStats(patch_fn=PATCHES, n_groups=2, vision_dp=2, group_size=2, enabled=False)
    off.record(make_batch(range(4), with_pixels=False))
    assert off.step_figures() == (None, None)  # and no collective: group_size 2 without a process group


def test_colocated_fan_out_plan_and_split():
    """language dp 2 + images tp 2, dp 1 on the same 2 ranks: each reads the whole micro-batch (the
    encoder's shard), keeps its language half and every sample's pixels."""
    layout = Layout.from_specs([parse_component("language=dp=2"), parse_component("images=tp=2,dp=1")], 2)
    plan = colocated_read_plan(layout, 1, 4)
    assert plan == ("images", 0, 1, slice(2, 4), slice(0, 4))
    assert (plan.module, plan.dp_rank, plan.dp_size) == ("images", 0, 1)
    batch = make_batch(range(4), with_pixels=True)
    out = ColocatedSplit.for_plan(plan, layout, image_token_id=IMAGE_TOKEN_ID)(encoder_slice_pixels(batch, plan.encoder))
    assert torch.equal(out["input_ids"], batch["input_ids"][2:4]) and torch.equal(out["sample_ids"], torch.tensor([2, 3]))
    assert torch.equal(out["pixel_values"], batch["pixel_values"])
    assert torch.equal(out["image_grid_thw"], batch["image_grid_thw"])
    # the padded bridge's counts: every sample's pixels are here, L is the shard's largest count
    tokens = image_tokens_per_sample(batch, IMAGE_TOKEN_ID)
    assert torch.equal(out["encoder_image_tokens"], tokens) and out["bridge_tokens_per_sample"] == int(tokens.max())


def _gather_once(rank, world):
    import torch.distributed as dist

    batches = [make_batch(range(4 * k + 2 * rank, 4 * k + 2 * rank + 2), with_pixels=False) for k in range(3)]
    once = VisionLoadStats(patch_fn=PATCHES, n_groups=2, vision_dp=2, group=None, group_size=world)
    for b in batches:
        once.record(b)
    figures = once.step_figures()
    per_mb = []  # what the feed computed before: one all-gather per micro-batch
    for b in batches:
        local = torch.tensor(PATCHES(b), dtype=torch.float64)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        per_mb.append(_spread(torch.cat(parts).tolist(), 2, 2))
    return figures, sum(per_mb) / len(per_mb)


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_one_gather_per_step_equals_one_per_micro_batch():
    for (before, after), want in run_distributed(_gather_once, 2):
        assert before == want and after is None
