"""Index mode's gathered costs (issue 33): each rank computes the costs of its own shard, one
all-gather gives every rank the whole micro-batch's, and the plan -- and so every rank's micro-batch
-- is the one the whole-read path gives (every rank running the text path of the whole micro-batch,
the implementation before) and the exchange's (the whole decoded micro-batch permuted by the
planner's order, cut into rank slices: an independent reference).

Real gloo ranks (4 processes), the demo data (small receipts, large pages, text-only and
multi-image rows): a DP-4 module without pixels and a DP-2 module with pixels in one world, both
laying out the same global order; the planner on its thread with DataLoader workers, and inline;
truncation drops (the replacement sample's cost travels with its position), a resume, the language
cost term; a refused sample raises the same line on every rank instead of leaving the others in
the collective; and the text path runs ``2 * micro_batch_size / dp`` times per micro-batch and rank
(own shard for the costs, owned samples for the batch), against ``micro_batch_size`` before.
"""

from __future__ import annotations

import pytest
import torch

from data_fixtures import demo_data, tiny_ckpt  # noqa: F401  (session fixtures)
from dist_utils import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]

MBS, GRID, STEPS = 16, 4, 4


class _Counting:
    """Counts the text path (``SamplePreprocessor.encode``) of one preprocessor, in this process:
    ``calls`` that returned a sample (a truncation drop also runs it for the sample it replaces)."""

    def __init__(self, pre):
        self.calls, inner = 0, pre.encode

        def encode(*a, **kw):
            out = inner(*a, **kw)  # TruncatedImageError: not counted, the replacement is
            self.calls += 1
            return out

        pre.encode = encode


def _fns(ckpt, language_weight):
    from mimo_sft.data.loader import model_token_info
    from mimo_sft.data.reorder import make_cost_fn, make_patch_count_fn

    info = model_token_info(ckpt)
    ids = dict(image_token_id=info["image_token_id"], merge_size=info["spatial_merge_size"])
    return make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=language_weight, **ids), make_patch_count_fn(**ids)


def _iter(cfg, ckpt, source, pre, **kw):
    from mimo_sft.data.loader import build_microbatch_iterator

    return build_microbatch_iterator(cfg, model_dir=ckpt, micro_batch_size=MBS, canonical_grid=GRID, seed=3,
                                     source=source, preprocessor=pre, **kw)


def _order(full: dict, cost_fn) -> list[int]:
    from mimo_sft.data.reorder import window_plan

    return window_plan.window_orders([cost_fn(full)], GRID)[0]


def _expected(full: dict, cost_fn, dp: int, r: int) -> dict:
    """The exchange's share of rank r: the whole decoded micro-batch in the planner's order, cut."""
    from mimo_sft.data.reorder import permute_batch
    from mimo_sft.data.reorder.serialize import merge_samples, split_samples

    order = _order(full, cost_fn)
    per = MBS // dp
    return merge_samples(split_samples(permute_batch(full, order))[r * per:(r + 1) * per])


def _scenario(rank, data, ckpt, *, seq_length, max_pixels, language_weight, workers, consumed, groups):
    """Both modules' new and whole-read iterators on this rank; returns the orders it saw."""
    import torch.distributed as dist

    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset

    cfg = DataConfig(dataset_path=str(data), seq_length=seq_length, max_pixels=max_pixels, dataloader_type="cyclic")
    source = load_sft_dataset(cfg)
    cost_fn, load_fn = _fns(ckpt, language_weight)
    base = dict(n_groups=GRID, cost_fn=cost_fn, load_fn=load_fn, stats_dp_sizes={"vision": 2})
    modules = {"language": (4, rank, False, groups["language"]), "vision": (2, rank // 2, True, groups["vision"])}
    whole = _iter(cfg, ckpt, source, build_preprocessor(cfg, ckpt), dp_size=1, dp_rank=0, need_pixels=True,
                  num_workers=0, consumed_samples=consumed)
    its, counts = {}, {}
    for name, (dp, r, pixels, group) in modules.items():
        for path, g, w in (("new", group, workers), ("old", None, 0)):
            pre = build_preprocessor(cfg, ckpt)
            counts[name, path] = _Counting(pre)
            its[name, path] = _iter(cfg, ckpt, source, pre, dp_size=dp, dp_rank=r, need_pixels=pixels, num_workers=w,
                                    consumed_samples=consumed, index_reorder={**base, "group": g})
    orders = []
    for _k in range(STEPS):
        full = next(whole)
        orders.append(_order(full, cost_fn))
        for name, (dp, r, pixels, _g) in modules.items():
            new, old = next(its[name, "new"]), next(its[name, "old"])
            assert set(new) == set(old), (name, sorted(set(new) ^ set(old)))
            for key in old:
                assert torch.equal(new[key], old[key]), (name, key)
            want = _expected(full, cost_fn, dp, r)
            for key in want:
                if pixels or key not in ("pixel_values", "image_grid_thw"):
                    assert torch.equal(new[key], want[key]), (name, key)
            a, b = its[name, "new"].last_stats, its[name, "old"].last_stats
            assert a["order"] == b["order"] == orders[-1], name
            assert {k: v for k, v in a.items() if k != "reorder_exchange_s"} == \
                   {k: v for k, v in b.items() if k != "reorder_exchange_s"}
    for name, (dp, _r, _p, _g) in modules.items():
        if workers == 0:  # everything ran here: own shard for the costs + owned samples, vs the whole micro-batch
            assert counts[name, "new"].calls == 2 * (MBS // dp) * STEPS
            assert counts[name, "old"].calls == MBS * STEPS
        its[name, "new"].shutdown()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, orders)
    assert all(g == orders for g in gathered), "ranks laid out different orders"
    return {"orders": orders, "dropped": whole.dataset.dropped}


def _refused(rank, data, ckpt, groups):
    """``--on-truncation error``: the sample is in one rank's shard; every rank raises its line."""
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.errors import UserError

    cfg = DataConfig(dataset_path=str(data), seq_length=48, max_pixels=12544, on_truncation="error",
                     dataloader_type="single")
    source, pre = load_sft_dataset(cfg), build_preprocessor(cfg, ckpt)
    cost_fn, load_fn = _fns(ckpt, 0.0)
    lines = []
    for g in (groups["language"], None):
        it = _iter(cfg, ckpt, source, pre, dp_size=4, dp_rank=rank, need_pixels=False, num_workers=0,
                   index_reorder=dict(n_groups=GRID, cost_fn=cost_fn, load_fn=load_fn, group=g))
        with pytest.raises(UserError) as err:
            next(it)
        lines.append(str(err.value))
    assert lines[0] == lines[1], lines  # the first refused sample in position order, as the whole read says
    return lines[0]


def _groups(rank) -> dict:
    import torch.distributed as dist

    groups = {"language": dist.new_group(list(range(4)), backend="gloo")}
    vision = [dist.new_group(ranks, backend="gloo") for ranks in ([0, 2], [1, 3])]  # DP 2, two replicas
    groups["vision"] = vision[rank % 2]
    return groups


def _world(rank, world, data, ckpt):
    # each scenario gets its own groups, as each run has its own: a shut-down iterator's gather thread may
    # still be prefetching on its group (seen: the next scenario's gathers paired with it on some ranks)
    groups, inline_groups, refused_groups = _groups(rank), _groups(rank), _groups(rank)
    return {
        # the planner on its thread, DataLoader workers, pixels on the DP-2 module
        "threaded": _scenario(rank, data, ckpt, seq_length=256, max_pixels=None, language_weight=0.0, workers=1,
                              consumed=0, groups=groups),
        # inline, truncation drops, resumed one micro-batch in, the language cost term
        "inline": _scenario(rank, data, ckpt, seq_length=48, max_pixels=12544, language_weight=0.5, workers=0,
                            consumed=MBS, groups=inline_groups),
        "refused": _refused(rank, data, ckpt, refused_groups),
    }


def test_gathered_costs_give_the_whole_read_plan(demo_data, tiny_ckpt):
    res = run_distributed(_world, 4, str(demo_data), str(tiny_ckpt), timeout=600)
    assert all(r == res[0] for r in res)
    per_mb = [len(set(o)) for o in res[0]["threaded"]["orders"]]
    assert per_mb == [MBS] * STEPS
    assert any(o != list(range(MBS)) for o in res[0]["threaded"]["orders"]), "nothing to balance: proves nothing"
    assert res[0]["inline"]["dropped"] > 0, "no truncation drop happened: the replacement path is untested"
    assert "--seq-length" in res[0]["refused"]
