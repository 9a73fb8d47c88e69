"""ReorderingBuffer over real gloo process groups: two modules with different DP sizes in one world.

Each world runs a "vision" module (micro-batches with pixels) and a "language" module (without),
each exchanging only inside its own DP groups, for several scenarios (overlap on/off, windows 1-3,
language cost term on/off). Every rank checks its outputs byte for byte against regenerated
originals; then all results are all-gathered and checked globally: both modules laid out the same
global order, equal to the pure planner's, and each micro-batch kept its samples and total cost.
"""

from __future__ import annotations

import gc
import math
import time

import pytest
import torch
import torch.distributed as dist

from mimo_sft.data.reorder import ReorderingBuffer, assign, make_cost_fn, make_patch_count_fn
from tests.reorder_helpers import IMAGE_TOKEN_ID, MERGE, assert_batch_intact, make_batch, run_world

pytestmark = pytest.mark.distributed

N_MICROBATCHES = 5
ALL_TEXT_MB = 2  # this global micro-batch has no image at all
SCENARIOS = [  # (overlap, window, language cost weight)
    (False, 1, 0.0),
    (True, 1, 0.0),
    (True, 2, 0.0),
    (False, 3, 0.0),
    (True, 3, 0.5),
    (False, 1, 0.5),
]


def _global_ids(k: int, mbs: int) -> list[int]:
    # spread ids so sample contents differ per micro-batch; deterministic
    return [1000 * (k + 1) + 7 * j for j in range(mbs)]


def _text_only(k: int) -> bool:
    return k == ALL_TEXT_MB


def _source(module: str, dp_rank: int, dp: int, mbs: int):
    per = mbs // dp
    for k in range(N_MICROBATCHES):
        ids = _global_ids(k, mbs)[dp_rank * per : (dp_rank + 1) * per]
        yield make_batch(ids, with_pixels=module == "vision", text_only=_text_only(k))


def _modules_worker(rank: int, world: int, layout: dict[str, list[int]], per_group: int) -> None:
    torch.manual_seed(0)
    n_groups = math.lcm(*(len(r) for r in layout.values()))
    mbs = n_groups * per_group
    groups = {}
    for name in sorted(layout):  # new_group is collective: same order on every rank
        ranks = layout[name]
        groups[name] = (dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo"))
    patch_fn = make_patch_count_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    text_ids = {i for i in _global_ids(ALL_TEXT_MB, mbs)}
    mine: dict = {}
    for s_idx, (overlap, window, lw) in enumerate(SCENARIOS):
        cost_fn = make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=lw, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
        for name in sorted(layout):
            if rank not in layout[name]:
                continue
            dp = len(layout[name])
            dp_rank = layout[name].index(rank)
            g, side = groups[name]
            buf = ReorderingBuffer(
                _source(name, dp_rank, dp, mbs), dp_rank=dp_rank, dp_size=dp, n_groups=n_groups,
                cost_fn=cost_fn, group=g, side_group=side, overlap=overlap, window_size=window,
                load_fn=patch_fn, stats_dp_sizes={"vision": len(layout["vision"])},
            )
            outs, stats = [], []
            with buf:
                for batch in buf:
                    outs.append(batch)
                    stats.append(dict(buf.last_stats))
            assert not buf.thread_alive, "overlap thread must exit once the source is exhausted"
            assert len(outs) == N_MICROBATCHES
            assert [s["window_len"] for s in stats] == [min(window, N_MICROBATCHES - (i - i % window)) for i in range(N_MICROBATCHES)]
            for k, b in enumerate(outs):
                assert_batch_intact(b, with_pixels=name == "vision", text_only_ids=text_ids)
                assert b["input_ids"].shape == (mbs // dp, b["input_ids"].shape[1])
                assert set(b["sample_ids"].tolist()) <= set(_global_ids(k, mbs)), "a sample left its micro-batch"
                if name == "vision":
                    assert b["pixel_values"].shape[0] == sum(patch_fn(b))
            mine[(s_idx, name, dp_rank)] = {
                "ids": [b["sample_ids"].tolist() for b in outs],
                "cost": [sum(cost_fn(b)) for b in outs],
                "patches": [sum(patch_fn(b)) for b in outs],
                "stats": stats,
            }
    everything: list = [None] * world
    dist.all_gather_object(everything, mine)
    merged = {k: v for d in everything for k, v in d.items()}
    for s_idx, (_overlap, _window, lw) in enumerate(SCENARIOS):
        cost_fn = make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=lw, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
        for k in range(N_MICROBATCHES):
            gids = _global_ids(k, mbs)
            orig = make_batch(gids, with_pixels=False, text_only=_text_only(k))
            costs = cost_fn(orig)
            expected = [gids[i] for i in assign.balanced_index_order(costs, n_groups)]
            for name, ranks in layout.items():
                got = [i for r in range(len(ranks)) for i in merged[(s_idx, name, r)]["ids"][k]]
                # both modules hold the same global order: sample i of canonical group g is one sample
                assert got == expected, (layout, s_idx, name, k, got, expected)
                total = sum(merged[(s_idx, name, r)]["cost"][k] for r in range(len(ranks)))
                assert total == pytest.approx(sum(costs)), "micro-batch cost changed"
                st = merged[(s_idx, name, 0)]["stats"][k]
                assert sum(st["cost_after"]) == pytest.approx(sum(st["cost_before"]))
                if len(ranks) == n_groups:
                    # guaranteed only at grid granularity: coarser modules sum several groups
                    assert st["cost_max_over_mean_after"] <= st["cost_max_over_mean_before"] + 1e-9
            # the language rank's view of vision load equals what the vision ranks really hold
            vision_after = [merged[(s_idx, "vision", r)]["patches"][k] for r in range(len(layout["vision"]))]
            for r in range(len(layout["language"])):
                assert merged[(s_idx, "language", r)]["stats"][k]["vision_load_after"] == vision_after
    # overlap on/off and window sizes never change what is served (per language weight)
    for s_idx, (_o, _w, lw) in enumerate(SCENARIOS):
        ref = next(i for i, sc in enumerate(SCENARIOS) if sc[2] == lw)
        for key, val in merged.items():
            if key[0] == s_idx:
                assert val["ids"] == merged[(ref,) + key[1:]]["ids"]


@pytest.mark.parametrize(
    "layout,world",
    [
        ({"vision": [0], "language": [1, 2]}, 3),  # (1, 2) disjoint, vision dp 1 permutes locally
        ({"vision": [0, 1], "language": [2, 3]}, 4),  # (2, 2) disjoint
        ({"vision": [0, 1], "language": [0, 1, 2]}, 3),  # (2, 3) sharing ranks, grid 6
        ({"vision": [0, 1], "language": [0, 1, 2, 3]}, 4),  # (2, 4) sharing ranks, grid 4
    ],
    ids=["dp1-2", "dp2-2", "dp2-3", "dp2-4"],
)
def test_modules_with_different_dp_agree(layout, world):
    run_world(_modules_worker, world, layout, 2)


# ---- worker-thread failure and shutdown ---------------------------------------------------------
def _faulty_source(dp_rank: int):
    for k in range(5):
        if k == 2:
            raise RuntimeError(f"injected fault on dp rank {dp_rank}")
        yield make_batch([10 * k + dp_rank * 2, 10 * k + dp_rank * 2 + 1], with_pixels=True)


def _lifecycle_worker(rank: int, world: int) -> None:
    import traceback

    cost_fn = make_cost_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    g, side = dist.new_group([0, 1], backend="gloo"), dist.new_group([0, 1], backend="gloo")
    # 1. an exception on the worker thread re-raises on the consumer with its original traceback
    buf = ReorderingBuffer(_faulty_source(rank), dp_rank=rank, dp_size=2, n_groups=2, cost_fn=cost_fn, group=g, side_group=side)
    got = [next(buf), next(buf)]
    assert len(got) == 2
    try:
        next(buf)
    except RuntimeError as exc:
        assert "injected fault" in str(exc)
        tb = "".join(traceback.format_exception(exc))
        assert "_faulty_source" in tb and "produce" in tb, tb  # the worker's frames survive
    else:
        raise AssertionError("worker failure did not reach the consumer")
    buf._thread.join(5)
    assert not buf.thread_alive
    with pytest.raises(StopIteration):
        next(buf)
    # 2. shutdown() mid-stream stops the thread (it is parked on the full queue)
    src = (make_batch([100 * k + rank * 2, 100 * k + rank * 2 + 1], with_pixels=False) for k in range(8))
    buf = ReorderingBuffer(src, dp_rank=rank, dp_size=2, n_groups=2, cost_fn=cost_fn, group=g, side_group=side)
    next(buf)
    time.sleep(0.3)  # let both ranks' threads finish windows 2 and 3 and park on the queue
    buf.shutdown()
    assert not buf.thread_alive
    # 3. a buffer dropped without shutdown() still stops its thread (__del__), and `with` works
    src = (make_batch([100 * k + rank * 2, 100 * k + rank * 2 + 1], with_pixels=False) for k in range(8))
    with ReorderingBuffer(src, dp_rank=rank, dp_size=2, n_groups=2, cost_fn=cost_fn, group=g, side_group=side) as buf:
        next(buf)
        time.sleep(0.3)
        thread = buf._thread
    assert not thread.is_alive()
    src = (make_batch([100 * k + rank * 2, 100 * k + rank * 2 + 1], with_pixels=False) for k in range(8))
    buf = ReorderingBuffer(src, dp_rank=rank, dp_size=2, n_groups=2, cost_fn=cost_fn, group=g, side_group=side)
    next(buf)
    time.sleep(0.3)
    thread = buf._thread
    del buf
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "dropping the buffer must stop its thread"
    # 4. an already balanced micro-batch (text only: every cost 0) moves nothing and copies nothing
    from mimo_sft.data.reorder import exchange_window

    flat = make_batch([500 + 2 * rank, 501 + 2 * rank], with_pixels=True, text_only=True)
    (same,), _ = exchange_window([flat], dp_rank=rank, dp_size=2, n_groups=2, cost_fn=cost_fn, group=g)
    assert all(same[k] is flat[k] for k in flat)
    # 5. data iterators out of step across the DP group: a clear RuntimeError on every rank, no hang
    batches = [make_batch([7 + 2 * rank + 4 * k, 8 + 2 * rank + 4 * k], with_pixels=True) for k in range(1 + rank)]
    with pytest.raises(RuntimeError, match="out of step"):
        exchange_window(batches, dp_rank=rank, dp_size=2, n_groups=2, cost_fn=cost_fn, group=g)
    dist.barrier()


def test_worker_failure_reaches_consumer_and_shutdown_stops_thread():
    run_world(_lifecycle_worker, 2)
