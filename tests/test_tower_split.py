"""A tower replicated on its tp ranks shares each micro-batch's units (``train.tower_split``): the contiguous
split is as even as unit boundaries allow, covers every unit once in order, and is the same on every rank; the
forecast keeps a replica's share of the activations. The training step against one process:
tests/test_context_parallel_e2e.py and the fan-out layouts of test_train_e2e.py, test_deepstack_e2e.py and
test_lora_e2e.py (their towers are replicated on 2 or 4 tp ranks)."""

import itertools
import random

from mimo_sft.memory.forecast import tower_share
from mimo_sft.train.tower_split import shares


def _brute(costs, parts):
    best = None
    for cut in itertools.combinations_with_replacement(range(len(costs) + 1), parts - 1):
        b = [0, *cut, len(costs)]
        worst = max(sum(costs[b[r]:b[r + 1]]) for r in range(parts))
        best = worst if best is None else min(best, worst)
    return best


def test_contiguous_shares_cover_every_unit_and_stay_within_one_unit_of_even():
    rng = random.Random(0)
    for _ in range(300):
        parts = rng.choice([2, 3, 4])
        costs = [float(rng.choice([64, 256, 256, 1024, 4096])) for _ in range(rng.randint(0, 9))]
        b = shares(costs, parts)
        assert len(b) == parts + 1 and b[0] == 0 and b[-1] == len(costs) and b == sorted(b)
        loads = [sum(costs[b[r]:b[r + 1]]) for r in range(parts)]
        assert sum(loads) == sum(costs)
        biggest = max(costs, default=0.0)
        assert max(loads, default=0.0) <= sum(costs) / parts + biggest, (costs, b)
        if costs:
            assert max(loads) <= 2 * _brute(costs, parts), (costs, b)  # nearest-boundary cuts: near the optimum
        assert shares(costs, parts) == b  # the same numbers, the same split (every replica computes it)


def test_a_long_clip_of_equal_temporal_patches_splits_evenly():
    assert shares([256.0] * 32, 4) == [0, 8, 16, 24, 32]
    assert shares([256.0] * 3, 4) == [0, 1, 1, 2, 3]  # fewer units than replicas: one each at most
    assert shares([4096.0, 64.0, 64.0, 64.0], 2) == [0, 1, 4]  # a page alone, the small ones together
    assert shares([], 2) == [0, 0, 0] and shares([5.0], 1) == [0, 1]


def test_the_forecast_keeps_a_replicas_share():
    assert tower_share(8192, 4, 256) == (2048 + 256) / 8192
    assert tower_share(8192, 1, 256) == 1.0 and tower_share(100, 4, 10_000) == 1.0 and tower_share(0, 4, 1) == 1.0
