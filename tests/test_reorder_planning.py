"""Pure planning: balance quality vs. brute force, determinism, invariants, costs, statistics."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from mimo_sft.data.reorder import assign, balance, cost_model, load_bounds, routing, window_plan
from mimo_sft.errors import UserError
from tests.reorder_helpers import IMAGE_TOKEN_ID, MERGE, assert_batch_intact, make_batch


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
            opt = load_bounds.optimal_max_load(costs, n_groups)
            assert opt == _brute_force(costs, n_groups)
            assert load_bounds.lower_bound_max_load(costs, n_groups) <= opt


@pytest.mark.parametrize("n_groups,per", [(2, 2), (2, 4), (2, 8), (3, 3), (4, 2), (4, 3), (4, 4), (8, 2)])
def test_balance_within_005_percent_of_optimum_on_average(n_groups, per):
    rng = random.Random(n_groups * 100 + per)
    ratios, lpt_ratios = [], []
    for _ in range(25):
        costs = _bimodal(rng, n_groups * per)
        opt = load_bounds.optimal_max_load(costs, n_groups)
        ratios.append(_max_load(costs, assign.balanced_groups(costs, n_groups)) / opt)
        lpt_ratios.append(_max_load(costs, assign.lpt_equal_count(costs, n_groups)) / opt)
    assert min(ratios) >= 1.0 - 1e-12  # the exact solver really is a lower bound
    assert sum(ratios) / len(ratios) <= 1.0005, sum(ratios) / len(ratios)  # 0.05 % on average
    # LPT is one of the small-case starts and refinement never makes a start worse
    assert all(r <= q + 1e-12 for r, q in zip(ratios, lpt_ratios))


def test_refinement_fixes_a_known_lpt_miss():
    """LPT puts 9,7,1 | 8,7,5 -> 20; the optimum 19 needs a swap LPT never considers."""
    costs = [7.0, 7.0, 1.0, 5.0, 9.0, 8.0]
    assert _max_load(costs, assign.lpt_equal_count(costs, 2)) == 20.0
    assert _max_load(costs, assign.balanced_groups(costs, 2)) == 19.0 == load_bounds.optimal_max_load(costs, 2)


def test_order_is_a_deterministic_equal_count_permutation():
    rng = random.Random(7)
    for n_groups, per in [(1, 4), (2, 3), (3, 4), (6, 2), (8, 8)]:
        costs = _bimodal(rng, n_groups * per)
        costs[0] = costs[1]  # ties must not break determinism
        a = assign.balanced_index_order(costs, n_groups)
        b = assign.balanced_index_order(list(costs), n_groups)
        assert a == b
        assert sorted(a) == list(range(len(costs)))
        assignment = assign.balanced_assignment(costs, n_groups, 1)
        assert [p for _r, p in sorted(assignment, key=lambda x: x[1])] == list(range(len(costs)))


def test_uniform_costs_keep_the_identity():
    assert assign.balanced_index_order([5.0] * 8, 4) == list(range(8))


def test_assignment_agrees_across_dp_sizes_on_the_canonical_grid():
    """Vision dp 2 and language dp 4 on grid 4: rank r of dp 2 holds exactly ranks 2r, 2r+1 of dp 4."""
    costs = _bimodal(random.Random(3), 16)
    a2 = assign.balanced_assignment(costs, 4, 2)
    a4 = assign.balanced_assignment(costs, 4, 4)
    a1 = assign.balanced_assignment(costs, 4, 1)
    order = assign.balanced_index_order(costs, 4)
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
        assign.balanced_index_order([1.0] * 5, 2)
    with pytest.raises(ValueError):
        assign.balanced_assignment([1.0] * 6, 6, 4)
    with pytest.raises(ValueError):
        assign.balanced_index_order([1.0] * 4, 0)
    with pytest.raises(ValueError):
        load_bounds.rank_loads([1.0] * 4, 2, 2, order=[0, 0, 1, 2])


def test_window_routes_keep_every_sample_in_its_slot():
    rng = random.Random(5)
    window = [_bimodal(rng, 8) for _ in range(3)]
    routes = window_plan.window_routes(window, 4, 2)
    assert len(routes) == 3
    for costs, route in zip(window, routes):
        assert route == assign.balanced_assignment(costs, 4, 2)
        assert sorted(route) == sorted((r, p) for r in range(2) for p in range(4))


def test_rank_loads_and_spread():
    costs = [10.0, 9.0, 1.0, 0.0]
    before = load_bounds.rank_loads(costs, 2, 2)
    assert before == [19.0, 1.0]
    after = load_bounds.rank_loads(costs, 2, 2, assign.balanced_index_order(costs, 2))
    assert sorted(after) == [10.0, 10.0]
    s = load_bounds.load_spread(before)
    assert s["max_over_mean"] == pytest.approx(1.9) and s["max_minus_min"] == 18.0
    assert load_bounds.load_spread([0.0, 0.0])["max_over_mean"] == 1.0
    assert sum(after) == sum(before)


def test_costs_identical_with_and_without_pixels():
    """The cost reads only input_ids/attention_mask, so vision and language batches agree."""
    ids = list(range(40, 52))
    vision = make_batch(ids, with_pixels=True)
    language = make_batch(ids, with_pixels=False)
    for lw in (0.0, 0.5):
        fn = cost_model.make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=lw, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
        assert fn(vision) == fn(language)
    # patches from input_ids equal the real pixel rows per sample
    patches = cost_model.make_patch_count_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)(vision)
    grid_rows = vision["image_grid_thw"].prod(-1).tolist()
    per_sample, k = [], 0
    for c in vision["image_counts"].tolist():
        per_sample.append(float(sum(grid_rows[k : k + c])))
        k += c
    assert patches == per_sample and sum(patches) == vision["pixel_values"].shape[0]


def test_sample_cost_formula():
    fields = {"input_ids": torch.tensor([IMAGE_TOKEN_ID] * 3 + [5, 6, 0]), "attention_mask": torch.tensor([True] * 5 + [False])}
    c = cost_model.sample_cost(fields, encoder_cost_weight=2.0, language_cost_weight=0.5, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
    assert c == 2.0 * 3 * 4 + 0.5 * 5
    with pytest.raises(UserError, match="both 0"):
        cost_model.make_cost_fn(encoder_cost_weight=0.0, language_cost_weight=0.0, image_token_id=1, merge_size=2)
    with pytest.raises(UserError, match=">= 0"):
        cost_model.make_cost_fn(encoder_cost_weight=-1.0, image_token_id=1, merge_size=2)
    # only the ratio matters: scaling both weights scales every cost, so the plan is unchanged
    ids = list(range(60, 76))
    batch = make_batch(ids, with_pixels=False)
    a = cost_model.make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=0.25, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)(batch)
    b = cost_model.make_cost_fn(encoder_cost_weight=4.0, language_cost_weight=1.0, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)(batch)
    assert assign.balanced_index_order(a, 4) == assign.balanced_index_order(b, 4)


def test_pure_modules_import_no_collectives():
    """planning (costs, assignment, windows, loads)/serialize must stay importable and testable without torch.distributed or megatron."""
    import ast
    import pathlib

    import mimo_sft.data.reorder as pkg

    root = pathlib.Path(pkg.__file__).parent
    for name in ("cost_model.py", "assign.py", "window_plan.py", "load_bounds.py", "balance.py", "serialize.py",
                 "colocated_plan.py", "coupled.py"):
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
    """Exhaustive-scan version of the swap refinement, in plain Python: the documented rule."""
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


def test_vectorised_refinement_matches_exhaustive_scan():
    """Up to ``REFINE_FIRST_PARTNERS`` groups the numpy refinement IS the exhaustive search: it
    takes the same swap as a plain scan in every round, ties (slot, group) included."""
    rng = random.Random(11)
    for trial in range(150):
        n_groups, per = rng.choice([(2, 4), (3, 5), (4, 8), (8, 8), (2, 32), (16, 4)])
        # integer costs with many ties stress the tie-breaks
        costs = [float(rng.choice([0, 64, 64, 256, 1024, 4096, rng.randint(0, 5000)])) for _ in range(n_groups * per)]
        start = assign.lpt_equal_count(costs, n_groups)
        grid = np.array(start, dtype=np.int64)
        eps = 1e-12 * max(1.0, max(costs))
        work = balance.Work(budget=10**9)
        balance.refine_swaps(np.array(costs), grid, work, eps, stop_at=-math.inf)
        slow = [list(g) for g in start]
        _reference_refine(costs, slow)
        assert grid.tolist() == slow, (trial, costs)
        assert work.swaps <= work.rounds


def _reference_lpt(costs, n_groups):
    """The O(n * G) scan LPT this module used before issue 16."""
    per = len(costs) // n_groups
    items = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    groups, loads = [[] for _ in range(n_groups)], [0.0] * n_groups
    for i in items:
        g = min((g for g in range(n_groups) if len(groups[g]) < per), key=lambda g: (loads[g], g))
        groups[g].append(i)
        loads[g] += costs[i]
    return groups


def test_heap_lpt_is_the_scan_lpt():
    rng = random.Random(13)
    for _ in range(200):
        n_groups, per = rng.choice([(1, 3), (2, 2), (3, 4), (5, 3), (8, 8), (16, 2)])
        costs = [float(rng.choice([0, 7, 7, 100, rng.randint(0, 300)])) for _ in range(n_groups * per)]
        assert assign.lpt_equal_count(costs, n_groups) == _reference_lpt(costs, n_groups)
    # equal costs: round robin by index
    assert assign.lpt_equal_count([1.0] * 12, 3) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


# ---------------------------------------------------------------------------------------------
# routing (routing.plan_exchange and its parts): what every DP rank sends and receives
# ---------------------------------------------------------------------------------------------
def _random_window(rng: random.Random, dp: int, n_slots: int, n_local: int):
    """Per-rank tables ``[rank][slot][sample]``: bimodal costs, distinct sizes (a src/dst mix-up shows)."""
    costs = [[_bimodal(rng, n_local) for _ in range(n_slots)] for _ in range(dp)]
    loads = [[[float(rng.randint(0, 99)) for _ in range(n_local)] for _ in range(n_slots)] for _ in range(dp)]
    nbytes = [[[8 * rng.randint(1, 10_000) for _ in range(n_local)] for _ in range(n_slots)] for _ in range(dp)]
    return costs, loads, nbytes


_ROUTING_CASES = [(2, 1, 1, 2), (2, 3, 2, 2), (3, 2, 2, 3), (4, 2, 3, 4), (4, 1, 4, 8), (2, 2, 4, 8), (6, 1, 2, 6)]


@pytest.mark.parametrize("dp,n_slots,n_local,n_groups", _ROUTING_CASES)
def test_send_and_recv_lists_mirror_each_other_across_ranks(dp, n_slots, n_local, n_groups):
    rng = random.Random(dp * 1000 + n_slots * 100 + n_local)
    for _ in range(20):
        costs, loads, nbytes = _random_window(rng, dp, n_slots, n_local)
        plans = [routing.plan_exchange(costs, loads, nbytes, dp_rank=r, n_groups=n_groups) for r in range(dp)]
        # every rank derives the same orders and routes from the same numbers
        assert all(p.routes == plans[0].routes and [i["order"] for i in p.infos] == [i["order"] for i in plans[0].infos]
                   for p in plans)
        for r in range(dp):
            for q in range(dp):
                assert plans[r].send[q] == plans[q].recv[r], (r, q)  # same moves, same wire order
                assert plans[r].send[q] == sorted(plans[r].send[q])
                if r != q:
                    assert plans[r].send_splits[q] == plans[q].recv_splits[r], (r, q)
            assert plans[r].send_splits[r] == plans[r].recv_splits[r] == 0  # what a rank keeps never travels
            # the receiver's canonical positions of every slot are filled exactly once
            filled = sorted((w, pos) for moves in plans[r].recv for w, pos, _i in moves)
            assert filled == [(w, pos) for w in range(n_slots) for pos in range(n_local)]
            # and every local sample leaves (or stays) exactly once
            sent = sorted((w, i) for moves in plans[r].send for w, _pos, i in moves)
            assert sent == [(w, i) for w in range(n_slots) for i in range(n_local)]
        moved = sum(nbytes[g // n_local][w][g % n_local]
                    for w, route in enumerate(plans[0].routes) for g, (owner, _pos) in enumerate(route)
                    if owner != g // n_local)
        assert sum(sum(p.send_splits) for p in plans) == sum(sum(p.recv_splits) for p in plans) == moved


def test_split_sizes_count_the_senders_records():
    # dp 2, two samples each; rank 0's sample 1 goes to rank 1 (position 0), rank 1's sample 0 to rank 0 (position 1)
    routes = [[(0, 0), (1, 0), (0, 1), (1, 1)]]
    nbytes = [[[10, 20]], [[30, 40]]]
    send, recv = routing.rank_moves(routes, dp_rank=0, dp_size=2, n_local=2)
    assert send == [[(0, 0, 0)], [(0, 0, 1)]] and recv == [[(0, 0, 0)], [(0, 1, 0)]]
    assert routing.split_sizes(send, recv, nbytes, dp_rank=0) == ([0, 20], [0, 30])
    send1, recv1 = routing.rank_moves(routes, dp_rank=1, dp_size=2, n_local=2)
    assert routing.split_sizes(send1, recv1, nbytes, dp_rank=1) == ([30, 0], [20, 0])
    with pytest.raises(ValueError, match="routes 3 samples"):
        routing.rank_moves([routes[0][:3]], dp_rank=0, dp_size=2, n_local=2)


def test_unchanged_slots_and_crossing_detection():
    identity = [(0, 0), (0, 1), (1, 0), (1, 1)]
    swapped_inside_rank0 = [(0, 1), (0, 0), (1, 0), (1, 1)]  # rank 0 keeps its samples, order flipped
    crossing = [(1, 0), (0, 1), (0, 0), (1, 1)]  # rank 0's sample 0 and rank 1's sample 0 trade places
    assert not routing.crosses_ranks([identity, swapped_inside_rank0], 2)
    assert routing.crosses_ranks([identity, crossing], 2)
    assert routing.unchanged_slots([identity, swapped_inside_rank0, crossing], dp_rank=0, n_local=2) == [True, False, False]
    assert routing.unchanged_slots([identity, swapped_inside_rank0, crossing], dp_rank=1, n_local=2) == [True, True, False]
    # a balanced micro-batch is not shuffled: nothing crosses, every slot unchanged, nothing staged
    flat = [[[5.0, 5.0]], [[5.0, 5.0]]]
    sizes = [[[8, 16]], [[24, 32]]]
    plan = routing.plan_exchange(flat, flat, sizes, dp_rank=1, n_groups=2)
    assert not plan.crosses and plan.unchanged == [True] and plan.send_splits == plan.recv_splits == [0, 0]


def test_dp1_routes_are_the_local_permutation():
    """The DP-1 path permutes by ``window_plan_info``'s order; the routing plan of one rank agrees."""
    rng = random.Random(21)
    for n_groups, n in [(1, 4), (2, 6), (4, 8)]:
        costs = [[_bimodal(rng, n) for _ in range(3)]]
        plan = routing.plan_exchange(costs, costs, [[[8] * n] * 3], dp_rank=0, n_groups=n_groups)
        infos = window_plan.window_plan_info(costs[0], costs[0], n_groups=n_groups, dp_size=1, stats_dp_sizes=None)
        assert not plan.crosses and plan.send_splits == plan.recv_splits == [0]
        for w, info in enumerate(infos):
            kept = sorted((pos, i) for ww, pos, i in plan.kept if ww == w)
            assert [i for _pos, i in kept] == info["order"]
            assert plan.unchanged[w] == (info["order"] == list(range(n)))


def test_global_slots_concatenate_ranks_in_rank_order():
    per_rank = [[["a0", "a1"], ["A0", "A1"]], [["b0", "b1"], ["B0", "B1"]]]
    assert routing.global_slots(per_rank) == [["a0", "a1", "b0", "b1"], ["A0", "A1", "B0", "B1"]]
    with pytest.raises(ValueError, match="ranks x"):
        routing.plan_exchange([[[1.0, 2.0]], [[3.0]]], [[[1.0, 2.0]], [[3.0]]], [[[8, 8]], [[8]]], dp_rank=0, n_groups=2)


def test_one_cost_formula_for_training_and_the_planner():
    """batch_costs (tensors, training) and weighted_costs on plain counts (the planner) agree bit for bit."""
    from mimo_sft.plan import simulate

    batch = make_batch(list(range(80, 96)), with_pixels=False)
    patches = cost_model.patch_counts(batch["input_ids"], image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    tokens = batch["attention_mask"].sum(-1)
    for ew, lw in [(1.0, 0.0), (0.7, 0.1), (0.3, 0.9), (1.0, 1 / 3)]:
        trained = cost_model.batch_costs(batch, encoder_cost_weight=ew, language_cost_weight=lw,
                                       image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
        plain = cost_model.weighted_costs([float(p) for p in patches], [float(t) for t in tokens],
                                        encoder_cost_weight=ew, language_cost_weight=lw)
        mb = simulate.MicroBatchLoad(list(range(16)), [float(p) for p in patches], [float(t) for t in tokens])
        assert trained == plain == simulate.costs_of(mb, ew, lw)
        assert trained == [ew * float(p) + lw * float(t) for p, t in zip(patches, tokens)]
    with pytest.raises(ValueError, match="token counts"):
        cost_model.weighted_costs([1.0], None, encoder_cost_weight=1.0, language_cost_weight=0.5)


@pytest.mark.parametrize("dp,n_slots,n_local,n_groups", [(2, 2, 3, 2), (3, 2, 2, 6), (4, 3, 2, 4)])
def test_pack_all_to_all_unpack_in_one_process(dp, n_slots, n_local, n_groups):
    """The exchange's pack and unpack steps around an in-process all-to-all: every rank ends with its
    canonical slice, byte for byte, and a byte missing from the wire is caught."""
    from mimo_sft.data.reorder import exchange, serialize

    cost_fn = cost_model.make_cost_fn(encoder_cost_weight=1.0, image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    ids = [[list(range(100 * w + n_local * r, 100 * w + n_local * (r + 1))) for w in range(n_slots)] for r in range(dp)]
    wins = [exchange._split_window([make_batch(s, with_pixels=True) for s in ids[r]], cost_fn, None) for r in range(dp)]
    gathered = exchange._Gathered(costs=[w.costs for w in wins], loads=[w.loads for w in wins],
                                  metas=[w.metas for w in wins])
    nbytes = [[[serialize.record_nbytes(m) for m in slot] for slot in rank] for rank in gathered.metas]
    plans = [routing.plan_exchange(gathered.costs, gathered.loads, nbytes, dp_rank=r, n_groups=n_groups)
             for r in range(dp)]
    sends = [exchange._pack(plans[r], wins[r], exchange.ScratchBuffers())[0] for r in range(dp)]
    chunks = [list(torch.split(sends[r], plans[r].send_splits)) for r in range(dp)]  # all-to-all by hand
    for q in range(dp):
        recv = torch.cat([chunks[r][q] for r in range(dp)])
        out = exchange._unpack(plans[q], wins[q], gathered, recv)
        for w, batch in enumerate(out):
            order = plans[q].infos[w]["order"]
            want = [ids[g // n_local][w][g % n_local] for g in order[q * n_local:(q + 1) * n_local]]
            assert batch["sample_ids"].tolist() == want
            assert_batch_intact(batch, with_pixels=True)
        if sum(plans[q].recv_splits):
            with pytest.raises(RuntimeError, match="bytes"):
                exchange._unpack(plans[q], wins[q], gathered, recv[:-8])
