"""Encoder-only balancing's plan (data.reorder.encoder_plan): which tower encodes each image.

Checked against the brute-force optimum on small cases (LPT's bound: within 4/3 - 1/(3m) of it), never
heavier than the layout as read, an image stays home when that is as good, and the case sample placement
cannot fix -- one sample of several pages -- is split.
"""

import itertools
import random

from mimo_sft.data.reorder.encoder_plan import encoder_destinations, spread, tower_loads


def _optimum(costs):
    flat = [c for cs in costs for c in cs]
    m = len(costs)
    best = float("inf")
    for assign in itertools.product(range(m), repeat=len(flat)):
        loads = [0.0] * m
        for c, q in zip(flat, assign):
            loads[q] += c
        best = min(best, max(loads))
    return best


def test_within_lpts_bound_of_the_brute_force_optimum_and_never_worse_than_as_read():
    rng = random.Random(0)
    for _ in range(150):
        m = rng.choice([2, 3])
        costs = [[float(rng.choice([16, 64, 256, 1024, 4096])) for _ in range(rng.randint(0, 3))] for _ in range(m)]
        dest = encoder_destinations(costs)
        assert [len(d) for d in dest] == [len(c) for c in costs]
        got, home = max(tower_loads(costs, dest)), max(tower_loads(costs))
        assert got <= home
        if sum(map(len, costs)) and sum(map(len, costs)) <= 7:
            assert got <= (4 / 3 - 1 / (3 * m)) * _optimum(costs) + 1e-9, (costs, dest)
        assert encoder_destinations(costs) == dest  # the same numbers, the same plan


def test_a_sample_of_several_pages_is_split_and_a_balanced_layout_stays():
    pages = [[4096.0, 4096.0, 4096.0, 4096.0], []]  # one rank holds a four-page sample, the other text only
    dest = encoder_destinations(pages)
    assert sorted(dest[0]) == [0, 0, 1, 1] and tower_loads(pages, dest) == [8192.0, 8192.0]
    assert spread(tower_loads(pages)) == 2.0 and spread(tower_loads(pages, dest)) == 1.0
    even = [[100.0, 50.0], [120.0, 30.0]]
    assert encoder_destinations(even) == [[0, 0], [1, 1]]  # 150 each as read: nothing moves
    assert encoder_destinations([[], []]) == [[], []] and encoder_destinations([[5.0]]) == [[0]]


def test_a_clip_is_cut_into_its_temporal_patches_whose_rows_are_the_clips():
    """``temporal_units``: an image stays one unit; a clip of T temporal patches (pixel grid ``(T*2, h, w)``)
    becomes T units of ``(2, h, w)``, in order, whose pixel and output rows add up to the clip's; a rank holding
    one long clip beside a text-only rank then shares it (the units plan like pages)."""
    import torch

    from mimo_sft.data.reorder.encoder_plan import temporal_units
    from mimo_sft.model.pixels import model_grid_thw

    grid = torch.tensor([[1, 8, 12], [8, 4, 6], [1, 2, 2], [2, 6, 4]])  # image, 4-patch clip, image, 1-patch clip
    units = temporal_units(grid, 2)
    assert units.tolist() == [[1, 8, 12], [2, 4, 6], [2, 4, 6], [2, 4, 6], [2, 4, 6], [1, 2, 2], [2, 6, 4]]
    assert int(units.prod(dim=1).sum()) == int(grid.prod(dim=1).sum())  # pixel rows
    assert int(model_grid_thw(units, 2).prod(dim=1).sum()) == int(model_grid_thw(grid, 2).prod(dim=1).sum())
    assert temporal_units(torch.zeros((0, 3), dtype=torch.int64), 2).shape == (0, 3)
    clip = [[float(p) for p in model_grid_thw(temporal_units(torch.tensor([[16, 8, 8]]), 2), 2).prod(dim=1).tolist()], []]
    dest = encoder_destinations(clip)
    assert tower_loads(clip, dest) == [256.0, 256.0] and sorted(dest[0]) == [0] * 4 + [1] * 4
