"""Pure planning: balance quality vs. brute force, determinism, invariants, costs, statistics."""

from __future__ import annotations

import itertools
import random
import pytest
import torch

from mimo_sft.data.reorder import planning
from mimo_sft.errors import UserError
from tests.reorder_helpers import IMAGE_TOKEN_ID, MERGE, make_batch


def _bimodal(rng: random.Random, n: int) -> list[float]:
    return [float(rng.randint(2000, 4000) if rng.random() < 0.3 else rng.randint(50, 400)) for _ in range(n)]


def _brute_force(costs, n_groups):
    """Enumerate every equal-count partition (tiny inputs only)."""
    n = len(costs)
    per = n // n_groups
    best = float("inf")
    for perm in itertools.permutations(range(n)):
        groups = [perm[g * per : (g + 1) * per] for g in range(n_groups)]
        if any(list(g) != sorted(g) for g in groups) or [g[0] for g in groups] != sorted(g[0] for g in groups):
            continue
        best = min(best, max(sum(costs[i] for i in g) for g in groups))
    return best


def _max_load(costs, groups):
    return max(sum(costs[i] for i in g) for g in groups)


def test_exact_solver_matches_brute_force():
    rng = random.Random(1)
    for n_groups, per in [(2, 2), (2, 3), (3, 2), (2, 4)]:
        for _ in range(6):
            costs = _bimodal(rng, n_groups * per)
            opt = planning.optimal_max_load(costs, n_groups)
            assert opt == _brute_force(costs, n_groups)
            assert planning.lower_bound_max_load(costs, n_groups) <= opt


@pytest.mark.parametrize("n_groups,per", [(2, 2), (2, 4), (2, 8), (3, 3), (4, 2), (4, 3), (4, 4), (8, 2)])
def test_balance_within_half_percent_of_optimum_on_average(n_groups, per):
    rng = random.Random(n_groups * 100 + per)
    ratios, lpt_ratios = [], []
    for _ in range(25):
        costs = _bimodal(rng, n_groups * per)
        opt = planning.optimal_max_load(costs, n_groups)
        ratios.append(_max_load(costs, planning.balanced_groups(costs, n_groups)) / opt)
        lpt_ratios.append(_max_load(costs, planning.lpt_equal_count(costs, n_groups)) / opt)
    assert min(ratios) >= 1.0 - 1e-12  # the exact solver really is a lower bound
    assert sum(ratios) / len(ratios) <= 1.005, sum(ratios) / len(ratios)
    assert sum(ratios) <= sum(lpt_ratios) + 1e-9  # refinement never makes LPT worse


def test_refinement_fixes_a_known_lpt_miss():
    """LPT puts 9,7,1 | 8,7,5 -> 20; the optimum 19 needs a swap LPT never considers."""
    costs = [7.0, 7.0, 1.0, 5.0, 9.0, 8.0]
    assert _max_load(costs, planning.lpt_equal_count(costs, 2)) == 20.0
    assert _max_load(costs, planning.balanced_groups(costs, 2)) == 19.0 == planning.optimal_max_load(costs, 2)


def test_order_is_a_deterministic_equal_count_permutation():
    rng = random.Random(7)
    for n_groups, per in [(1, 4), (2, 3), (3, 4), (6, 2), (8, 8)]:
        costs = _bimodal(rng, n_groups * per)
        costs[0] = costs[1]  # ties must not break determinism
        a = planning.balanced_index_order(costs, n_groups)
        b = planning.balanced_index_order(list(costs), n_groups)
        assert a == b
        assert sorted(a) == list(range(len(costs)))
        assignment = planning.balanced_assignment(costs, n_groups, 1)
        assert [p for _r, p in sorted(assignment, key=lambda x: x[1])] == list(range(len(costs)))


def test_uniform_costs_keep_the_identity():
    assert planning.balanced_index_order([5.0] * 8, 4) == list(range(8))


def test_assignment_agrees_across_dp_sizes_on_the_canonical_grid():
    """Vision dp 2 and language dp 4 on grid 4: rank r of dp 2 holds exactly ranks 2r, 2r+1 of dp 4."""
    costs = _bimodal(random.Random(3), 16)
    a2 = planning.balanced_assignment(costs, 4, 2)
    a4 = planning.balanced_assignment(costs, 4, 4)
    a1 = planning.balanced_assignment(costs, 4, 1)
    order = planning.balanced_index_order(costs, 4)
    for i in range(16):
        r2, p2 = a2[i]
        r4, p4 = a4[i]
        r1, p1 = a1[i]
        assert r2 == r4 // 2 and p2 == (r4 % 2) * 4 + p4
        assert r1 == 0 and order[p1] == i
    counts = [sum(1 for r, _ in a4 if r == k) for k in range(4)]
    assert counts == [4, 4, 4, 4]


def test_bad_grids_are_rejected():
    with pytest.raises(ValueError):
        planning.balanced_index_order([1.0] * 5, 2)
    with pytest.raises(ValueError):
        planning.balanced_assignment([1.0] * 6, 6, 4)
    with pytest.raises(ValueError):
        planning.balanced_index_order([1.0] * 4, 0)
    with pytest.raises(ValueError):
        planning.rank_loads([1.0] * 4, 2, 2, order=[0, 0, 1, 2])


def test_window_routes_keep_every_sample_in_its_slot():
    rng = random.Random(5)
    window = [_bimodal(rng, 8) for _ in range(3)]
    routes = planning.window_routes(window, 4, 2)
    assert len(routes) == 3
    for costs, route in zip(window, routes):
        assert route == planning.balanced_assignment(costs, 4, 2)
        assert sorted(route) == sorted((r, p) for r in range(2) for p in range(4))


def test_rank_loads_and_spread():
    costs = [10.0, 9.0, 1.0, 0.0]
    before = planning.rank_loads(costs, 2, 2)
    assert before == [19.0, 1.0]
    after = planning.rank_loads(costs, 2, 2, planning.balanced_index_order(costs, 2))
    assert sorted(after) == [10.0, 10.0]
    s = planning.load_spread(before)
    assert s["max_over_mean"] == pytest.approx(1.9) and s["max_minus_min"] == 18.0
    assert planning.load_spread([0.0, 0.0])["max_over_mean"] == 1.0
    assert sum(after) == sum(before)


def test_costs_identical_with_and_without_pixels():
    """The cost reads only input_ids/attention_mask, so vision and language batches agree."""
    ids = list(range(40, 52))
    vision = make_batch(ids, with_pixels=True)
    language = make_batch(ids, with_pixels=False)
    for lw in (0.0, 0.5):
        fn = planning.make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=lw, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
        assert fn(vision) == fn(language)
    # patches from input_ids equal the real pixel rows per sample
    patches = planning.make_patch_count_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)(vision)
    grid_rows = vision["image_grid_thw"].prod(-1).tolist()
    per_sample, k = [], 0
    for c in vision["image_counts"].tolist():
        per_sample.append(float(sum(grid_rows[k : k + c])))
        k += c
    assert patches == per_sample and sum(patches) == vision["pixel_values"].shape[0]


def test_sample_cost_formula():
    fields = {"input_ids": torch.tensor([IMAGE_TOKEN_ID] * 3 + [5, 6, 0]), "attention_mask": torch.tensor([True] * 5 + [False])}
    c = planning.sample_cost(fields, encoder_cost_weight=2.0, language_cost_weight=0.5, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
    assert c == 2.0 * 3 * 4 + 0.5 * 5
    with pytest.raises(UserError, match="both 0"):
        planning.make_cost_fn(encoder_cost_weight=0.0, language_cost_weight=0.0, image_token_id=1, merge_size=2)
    with pytest.raises(UserError, match=">= 0"):
        planning.make_cost_fn(encoder_cost_weight=-1.0, image_token_id=1, merge_size=2)
    # only the ratio matters: scaling both weights scales every cost, so the plan is unchanged
    ids = list(range(60, 76))
    batch = make_batch(ids, with_pixels=False)
    a = planning.make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=0.25, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)(batch)
    b = planning.make_cost_fn(encoder_cost_weight=4.0, language_cost_weight=1.0, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)(batch)
    assert planning.balanced_index_order(a, 4) == planning.balanced_index_order(b, 4)


def test_pure_modules_import_no_collectives():
    """planning/serialize must stay importable and testable without torch.distributed or megatron."""
    import ast
    import pathlib

    import mimo_sft.data.reorder as pkg

    root = pathlib.Path(pkg.__file__).parent
    for name in ("planning.py", "serialize.py"):
        tree = ast.parse((root / name).read_text())
        mods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mods.add(node.module or "")
                mods.update(f"{node.module}.{a.name}" for a in node.names)
        bad = [m for m in mods if "distributed" in m or m.startswith("megatron") or m.endswith(".exchange") or m.endswith(".buffer")]
        assert not bad, (name, bad)


def _reference_refine(costs, groups, max_rounds=10_000):
    """Exhaustive-scan version of the swap refinement: the bisection must pick the same swaps."""
    loads = [sum(costs[i] for i in g) for g in groups]
    eps = 1e-12 * max(1.0, max(abs(c) for c in costs))
    for _ in range(max_rounds):
        h = max(range(len(groups)), key=lambda g: (loads[g], -g))
        best = None
        for g in range(len(groups)):
            gap = loads[h] - loads[g]
            if g == h or gap <= eps:
                continue
            for a, i in enumerate(groups[h]):
                for b, j in enumerate(groups[g]):
                    d = costs[i] - costs[j]
                    if d <= 0 or d >= gap - eps:
                        continue
                    key = (max(loads[h] - d, loads[g] + d), g, a, b)
                    best = key if best is None or key < best else best
        if best is None:
            return
        _, g, a, b = best
        i, j = groups[h][a], groups[g][b]
        groups[h][a], groups[g][b] = j, i
        loads[h] -= costs[i] - costs[j]
        loads[g] += costs[i] - costs[j]


def test_bisection_refinement_matches_exhaustive_scan():
    rng = random.Random(11)
    for trial in range(150):
        n_groups, per = rng.choice([(2, 4), (3, 5), (4, 8), (8, 8), (2, 32)])
        # integer costs with many ties stress the leftmost-slot tie-break
        costs = [float(rng.choice([0, 64, 64, 256, 1024, 4096, rng.randint(0, 5000)])) for _ in range(n_groups * per)]
        start = planning.lpt_equal_count(costs, n_groups)
        fast = [list(g) for g in start]
        slow = [list(g) for g in start]
        planning._refine_by_swaps(costs, fast, max_rounds=10_000)
        _reference_refine(costs, slow)
        assert fast == slow, (trial, costs)
