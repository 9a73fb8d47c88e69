#!/usr/bin/env python
"""Benchmarks for intra-microbatch reordering (issue #5); results go to docs/benchmarks.md.

  (a) balance quality on random bimodal image costs: heaviest rank over the optimum (exact branch
      and bound where it is cheap, else a lower bound, which makes the ratio an upper estimate)
      for no reordering, plain equal-count LPT, and ours (``assign.balanced_groups``);
  (b) the exchange over real gloo groups: MB/s of serialize + all_to_all_single + reassemble
      against a raw all_to_all_single of a ready byte buffer with the same splits;
  (c) planning time for 64 samples, and the DP-1 local permutation of 4 realistic samples;
  (d) planning at cluster scale (issue 16): encoder dp 16-512 x 4-16 samples per rank, plan time
      of ``balanced_index_order`` against plain heap LPT of the same costs, quality against the
      lower bounds, and the work the planner counted (candidate swaps examined per sample).

  (f) colocated layouts (issue 46): the per-GPU plan (``colocated_plan.colocated_order``) at 64 and 256
      groups x 8 samples, equal DP, fan-in and fan-out, against heap LPT of the combined costs in CPU
      and wall time, and its heaviest GPU over the mean GPU (a lower bound) against the layout as read.

  (e) with ``--baseline FILE``: plan time and quality of another ``assign.py`` (or of the
      ``planning.py`` it was split from, say the one before issue 16, taken from git) against
      ours, dp 8-256 x 8 samples per rank.

Usage: python scripts/bench_reorder.py [--trials 200] [--iters 10] [--scale-trials 10]
                                       [--skip-balance] [--skip-exchange] [--skip-scale] [--scale-only]
                                       [--baseline PLANNING_PY] [--colocated-only]

Timings are best-of-N (the machine these ran on is shared); quality figures are exact.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from mimo_sft.data.reorder import assign, cost_model, exchange, load_bounds, serialize  # noqa: E402

IMAGE_TOKEN_ID = 151655
MERGE = 2
PATCH_DIM = 3 * 2 * 14 * 14  # Qwen2.5-VL: C * temporal_patch * patch * patch
SEQ = 2048


def bimodal(rng: random.Random, n: int) -> list[float]:
    """30% large images (2000-4000 patches), 70% small (50-400): documents mixed with thumbnails."""
    return [float(rng.randint(2000, 4000) if rng.random() < 0.3 else rng.randint(50, 400)) for _ in range(n)]


def heaviest(costs, groups) -> float:
    return max(sum(costs[i] for i in g) for g in groups)


def table_balance(trials: int, seed: int) -> None:
    print("\n(a) heaviest-rank cost / optimum, bimodal image costs "
          f"({trials} micro-batches per row; 'ref' = exact optimum or lower bound)")
    print("| dp | samples/rank | ref | none mean | none worst | LPT mean | LPT worst | ours mean | ours worst | ours plan ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rng = random.Random(seed)
    for dp in (2, 4, 8):
        for per in (2, 4, 8):
            n = dp * per
            exact = n <= 16
            res = {"none": [], "lpt": [], "ours": []}
            plan_s = []
            for _ in range(trials):
                c = bimodal(rng, n)
                ref = load_bounds.optimal_max_load(c, dp) if exact else load_bounds.lower_bound_max_load(c, dp)
                res["none"].append(heaviest(c, [range(g * per, (g + 1) * per) for g in range(dp)]) / ref)
                res["lpt"].append(heaviest(c, assign.lpt_equal_count(c, dp)) / ref)
                t0 = time.perf_counter()
                groups = assign.balanced_groups(c, dp)
                plan_s.append(time.perf_counter() - t0)
                res["ours"].append(heaviest(c, groups) / ref)
            cells = []
            for k in ("none", "lpt", "ours"):
                cells += [f"{statistics.mean(res[k]):.4f}", f"{max(res[k]):.4f}"]
            print(f"| {dp} | {per} | {'exact' if exact else 'bound'} | " + " | ".join(cells)
                  + f" | {1e3 * statistics.mean(plan_s):.3f} |")


def table_scale(trials: int, seed: int) -> None:
    print("\n(d) planning at cluster scale, bimodal image costs, one core "
          f"({trials} micro-batches per row; times: best of 3 calls per micro-batch, median over micro-batches)")
    print("| encoder dp | samples/rank | samples | plan ms | LPT ms | plan / LPT | ours / bound mean | ours / bound worst "
          "| ours / pigeonhole bound mean | LPT / bound mean | swaps examined per sample |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dp in (16, 32, 64, 128, 256, 512):
        for per in (4, 8, 16):
            rng = random.Random(seed * 1_000_003 + dp * 101 + per)
            plan_t, lpt_t, ratio, ours, ours_pig, lpt, work = [], [], [], [], [], [], []
            for _ in range(trials):
                c = bimodal(rng, dp * per)
                bound = max(sum(c) / dp, max(c))
                tp = _time(lambda: assign.balanced_index_order(c, dp), 3)
                tl = _time(lambda: assign.lpt_equal_count(c, dp), 3)
                plan_t.append(tp)
                lpt_t.append(tl)
                ratio.append(tp / tl)
                order = assign.balanced_index_order(c, dp)
                top = max(sum(c[i] for i in order[g * per:(g + 1) * per]) for g in range(dp))
                ours.append(top / bound)
                ours_pig.append(top / load_bounds.lower_bound_max_load(c, dp))
                lpt.append(heaviest(c, assign.lpt_equal_count(c, dp)) / bound)
                _grid, works = assign._balanced_grid(c, dp)
                work.append(sum(w.examined for w in works) / (dp * per))
            print(f"| {dp} | {per} | {dp * per} | {1e3 * statistics.median(plan_t):.2f} | {1e3 * statistics.median(lpt_t):.2f} "
                  f"| {statistics.median(ratio):.1f} | {statistics.mean(ours):.5f} | {max(ours):.5f} "
                  f"| {statistics.mean(ours_pig):.5f} | {statistics.mean(lpt):.4f} | {statistics.mean(work):.0f} |")


def table_colocated(trials: int, seed: int) -> None:
    from mimo_sft.data.reorder.colocated_plan import ColocatedGrid, colocated_order, group_loads, sample_terms

    print("\n(f) colocated layouts: the per-GPU plan, bimodal patches, tokens 100-3000, one core "
          f"({trials} micro-batches per row; times: best of 3 calls per micro-batch, median over micro-batches; "
          "CPU = time.process_time of this process, wall = time.perf_counter)")
    print("| layout | groups | samples | language weight | plan CPU ms | LPT CPU ms | plan / LPT, CPU "
          "| plan / LPT, wall | heaviest GPU / mean, as read | heaviest GPU / mean, planned (worst) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for G in (64, 256):
        for name, grid in (("equal DP", ColocatedGrid(G, G, 1)), ("fan-in, language tp 2", ColocatedGrid(G, G // 2, 2)),
                           ("fan-in, language tp 4", ColocatedGrid(G, G // 4, 4)),
                           ("fan-out, images tp 2", ColocatedGrid(G // 2, G, 1))):
            for wl in (0.0, 1.0):
                rng = random.Random(seed * 1_000_003 + G * 101 + grid.block * 7 + int(wl))
                cpu, lpt_cpu, ratio, wall_ratio, before, after = [], [], [], [], [], []
                for _ in range(trials):
                    n = G * 8
                    v, lang = sample_terms(bimodal(rng, n), [float(rng.randint(100, 3000)) for _ in range(n)], grid,
                                           encoder_cost_weight=1.0, language_cost_weight=wl)
                    both = (v + lang).tolist()
                    plan, lpt = (lambda: colocated_order(v, lang, grid)), (lambda: assign.lpt_equal_count(both, G))
                    tp, tl = _time(plan, 3, time.process_time), _time(lpt, 3, time.process_time)
                    cpu.append(tp)
                    lpt_cpu.append(tl)
                    ratio.append(tp / tl)
                    wall_ratio.append(_time(plan, 3) / _time(lpt, 3))
                    loads = group_loads(v, lang, grid, colocated_order(v, lang, grid))
                    mean = sum(loads) / len(loads)
                    after.append(max(loads) / mean)
                    before.append(max(group_loads(v, lang, grid)) / mean)
                print(f"| {name} | {G} | {G * 8} | {wl:g} | {1e3 * statistics.median(cpu):.2f} "
                      f"| {1e3 * statistics.median(lpt_cpu):.2f} | {statistics.median(ratio):.1f} "
                      f"| {statistics.median(wall_ratio):.1f} "
                      f"| {statistics.mean(before):.3f} | {statistics.mean(after):.5f} ({max(after):.5f}) |")


def table_baseline(path: str, seed: int) -> None:
    """Plan time and quality of another ``assign.py`` / older ``planning.py`` (any module with
    ``balanced_index_order``, e.g. the one before issue 16) next to ours."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_planning", path)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    print(f"\n(e) before / after, bimodal image costs, one core (baseline: {path}; "
          "one call per micro-batch, median over micro-batches)")
    print("| encoder dp x samples/rank | samples | micro-batches | baseline plan ms | baseline / bound mean "
          "| ours plan ms | ours / bound mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dp, per, trials in ((8, 8, 10), (64, 8, 5), (128, 8, 3), (256, 8, 3)):
        rng = random.Random(seed * 1_000_003 + dp * 101 + per)
        times: dict = {"base": [], "ours": []}
        quality: dict = {"base": [], "ours": []}
        for _ in range(trials):
            c = bimodal(rng, dp * per)
            bound = max(sum(c) / dp, max(c))
            for key, mod in (("base", base), ("ours", assign)):
                t0 = time.perf_counter()
                order = mod.balanced_index_order(c, dp)
                times[key].append(time.perf_counter() - t0)
                quality[key].append(max(sum(c[i] for i in order[g * per:(g + 1) * per]) for g in range(dp)) / bound)
        print(f"| {dp} x {per} | {dp * per} | {trials} | {1e3 * statistics.median(times['base']):.1f} "
              f"| {statistics.mean(quality['base']):.5f} | {1e3 * statistics.median(times['ours']):.1f} "
              f"| {statistics.mean(quality['ours']):.5f} |")


def realistic_batch(sample_ids, patches_per_sample, *, with_pixels: bool) -> dict[str, torch.Tensor]:
    """Contract-shaped micro-batch: one image per sample (0 patches = text-only), seq 2048."""
    b = len(sample_ids)
    input_ids = torch.randint(10, 1000, (b, SEQ))
    grids = []
    for i, p in enumerate(patches_per_sample):
        tokens = p // (MERGE * MERGE)
        input_ids[i, :tokens] = IMAGE_TOKEN_ID
        if p:
            grids.append((1, MERGE, p // MERGE))
    out = {
        "input_ids": input_ids,
        "labels": input_ids.roll(-1, 1),
        "loss_mask": torch.ones(b, SEQ),
        "attention_mask": torch.ones(b, SEQ, dtype=torch.bool),
        "position_ids": torch.arange(SEQ).expand(3, b, SEQ).contiguous(),
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN_ID).long(),
        "image_counts": torch.tensor([1 if p else 0 for p in patches_per_sample]),
        "sample_ids": torch.tensor(list(sample_ids)),
    }
    if with_pixels:
        out["pixel_values"] = torch.randn(sum(patches_per_sample), PATCH_DIM)
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    return out


def _exchange_worker(rank: int, world: int, port: int, per_rank: int, iters: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(list(range(world)), backend="gloo")
    # worst case for the read order: rank 0 drew every big image
    patches = [4096 if rank == 0 else 256 for _ in range(per_rank)]
    batch = realistic_batch(range(rank * per_rank, (rank + 1) * per_rank), patches, with_pixels=True)
    cost_fn = cost_model.make_cost_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    times, moved = [], 0
    for it in range(iters + 2):
        dist.barrier(group)
        t0 = time.perf_counter()
        out, infos = exchange.exchange_window([batch], dp_rank=rank, dp_size=world, n_groups=world,
                                              cost_fn=cost_fn, group=group)
        dt = time.perf_counter() - t0
        if it >= 2:
            times.append(dt)
    order = infos[0]["order"]
    # bytes this rank sent = records it gave away
    per = per_rank
    recs = serialize.split_samples(batch)
    for k, g in enumerate(order):
        src, i = divmod(g, per)
        if src == rank and k // per != rank:
            moved += serialize.record_nbytes(serialize.record_meta(recs[i]))
    # raw all_to_all of the same byte counts
    sizes = torch.tensor([moved], dtype=torch.long)
    all_sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    # spread each rank's moved bytes evenly over the other ranks (same total volume)
    def splits(n):
        s = [0] * world
        others = [r for r in range(world) if r != rank] if n else []
        for j, r in enumerate(others):
            s[r] = n // len(others) + (1 if j < n % len(others) else 0)
        return s
    send_splits = splits(moved)
    recv_splits = []
    for r in range(world):
        n = int(all_sizes[r])
        others = [x for x in range(world) if x != r]
        j = others.index(rank) if rank in others else 0
        recv_splits.append(0 if r == rank else n // len(others) + (1 if j < n % len(others) else 0))
    send = torch.randint(0, 255, (moved,), dtype=torch.uint8)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8)
    raw = []
    for it in range(iters + 2):
        dist.barrier(group)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        dt = time.perf_counter() - t0
        if it >= 2:
            raw.append(dt)
    total = torch.tensor([float(moved)])
    dist.all_reduce(total, group=group)
    t_ex = torch.tensor([min(times)])
    t_raw = torch.tensor([min(raw)])
    dist.all_reduce(t_ex, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(t_raw, op=dist.ReduceOp.MAX, group=group)
    clone = []
    for it in range(iters + 2):
        t0 = time.perf_counter()
        send.clone()
        if it >= 2:
            clone.append(time.perf_counter() - t0)
    t_clone = torch.tensor([min(clone)])
    dist.all_reduce(t_clone, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        q.put((world, per_rank, float(total), float(t_ex), float(t_raw), float(t_clone),
               max(infos[0]["cost_before"]) / max(infos[0]["cost_after"])))
    dist.destroy_process_group()


def table_exchange(iters: int) -> None:
    print("\n(b) exchange over gloo (one window, worst-case read order: rank 0 holds all 4096-patch images, "
          f"others 256-patch; f32 pixels, seq {SEQ}; best of {iters} per rank, slowest rank)")
    print("| processes | samples/rank | MB moved (all ranks) | reorder ms | reorder MB/s | raw all_to_all ms | raw MB/s | clone of sent bytes ms | heaviest-rank cost cut |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ctx = mp.get_context("spawn")
    for world in (2, 3, 4):
        for per_rank in (2, 4):
            q = ctx.SimpleQueue()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_exchange_worker, args=(world, port, per_rank, iters, q), nprocs=world, join=True)
            w, p, moved, t_ex, t_raw, t_clone, cut = q.get()
            mb = moved / 1e6
            print(f"| {w} | {p} | {mb:.1f} | {1e3 * t_ex:.1f} | {mb / t_ex:.0f} | {1e3 * t_raw:.1f} | {mb / t_raw:.0f} "
                  f"| {1e3 * t_clone:.1f} | {cut:.2f}x |")


def _time(fn, reps: int, clock=time.perf_counter) -> float:
    """Best of ``reps`` single calls: the least disturbed by other processes on a shared machine
    (``clock=time.process_time``: this process's CPU time, which other processes disturb less)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def table_timing() -> None:
    print("\n(c) planning and the DP-1 local permutation (training-thread cost)")
    print("| what | time |")
    print("|---|---:|")
    rng = random.Random(0)
    for g in (2, 4, 8):
        costs = bimodal(rng, 64)
        t = _time(lambda: assign.balanced_assignment(costs, g, g), 50)
        print(f"| plan 64 samples, grid {g} | {1e3 * t:.2f} ms |")
    cost_fn = cost_model.make_cost_fn(image_token_id=IMAGE_TOKEN_ID, merge_size=MERGE)
    patches = [4096, 256, 1024, 64]  # 4 realistic samples: ~29 MB of f32 pixels
    for with_pixels in (False, True):
        batch = realistic_batch(range(4), patches, with_pixels=with_pixels)
        t = _time(lambda: exchange.reorder_local([batch], n_groups=2, cost_fn=cost_fn), 50)
        label = "vision (with pixel_values)" if with_pixels else "language (no pixels)"
        print(f"| DP-1 permute, 4 samples seq {SEQ}, {label} | {1e3 * t:.3f} ms |")
        if with_pixels:
            pv = batch["pixel_values"]
            tc = _time(lambda: pv.clone(), 50)
            print(f"| plain clone of the same pixel_values ({pv.numel() * 4 / 1e6:.0f} MB) | {1e3 * tc:.3f} ms |")
    batch = realistic_batch(range(4), patches, with_pixels=False)
    t = _time(lambda: cost_fn(batch), 200)
    print(f"| cost_fn, 4 samples seq {SEQ} | {1e3 * t:.3f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-exchange", action="store_true")
    ap.add_argument("--skip-balance", action="store_true")
    ap.add_argument("--scale-trials", type=int, default=10)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--scale-only", action="store_true", help="only table (d) (and (e) with --baseline)")
    ap.add_argument("--colocated-only", action="store_true", help="only table (f), colocated layouts")
    ap.add_argument("--baseline", metavar="PLANNING_PY",
                    help="table (e): compare with another assign.py or an older planning.py, e.g. "
                         "`git show <rev>:mimo_sft/data/reorder/planning.py > /tmp/old_planning.py`")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    if args.colocated_only:
        return table_colocated(args.scale_trials, args.seed)
    if not args.scale_only:
        if not args.skip_balance:
            table_balance(args.trials, args.seed)
        table_timing()
    if not args.skip_scale:
        table_scale(args.scale_trials, args.seed)
    if not args.skip_scale:
        table_colocated(args.scale_trials, args.seed)
    if args.baseline:
        table_baseline(args.baseline, args.seed)
    if not args.skip_exchange and not args.scale_only:
        table_exchange(args.iters)


if __name__ == "__main__":
    main()
