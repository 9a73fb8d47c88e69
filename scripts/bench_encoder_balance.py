#!/usr/bin/env python
"""Colocated layouts: does encoder-only balancing beat sample placement? (issue 46; docs/benchmarks.md)

On a colocated layout every GPU encodes its vision slice's images, then computes ``1 / language tp``
of its language DP rank's samples; the step waits for the heaviest GPU. mimo-sft balances this by
placing whole samples (``colocated_plan.colocated_order``). Encoder-only balancing (VeOmni's
EncoderDataBalance) instead leaves the language placement alone and sends pixels to the least-loaded
GPU's tower, and the embeddings and their gradients back. This script measures both on one cost
model, heaviest GPU over the mean GPU (what a step waits for, over what a perfect balance would wait):

  (a) as read;
  (b) sample placement: ``colocated_order`` on the per-sample FLOPs below (its best case: mimo-sft's
      planner counts patches and tokens linearly -- (b lin) plans on those counts with weights fitted
      to the mean FLOPs per patch and per token, and is scored on the FLOPs);
  (c) encoder-only on the as-read language placement: each GPU's language load fixed, the vision work
      dealt by LPT (largest first onto the GPU with the least vision + language load; a tie keeps it
      home; the layout as read is kept if LPT is worse), per image and per whole sample. The bound
      the issue asks for: the exchange costs nothing and no GPU waits for another between the tower
      and the decoder;
  (d) both: sample placement, then the same encoder-only LPT on top of it;
  (c floor) the heaviest GPU's language load alone over the mean: no vision move goes below it;
  (d dep floor) what (c) / (d) leave out: a GPU's decoder cannot start before every image of its
      language slice is encoded, wherever, nor its tower backward end before its decoder backward,
      so no schedule of whole images ends a GPU before its language load plus its slice's largest
      image (on (b)'s placement). Where (d) is below it, (d) is out of reach;
  (c sync) / (d sync) the same with the exchange as what it is, a collective between the phases: a
      GPU's decoder needs its images' embeddings, so it starts when the slowest tower is done (and
      the towers' backward when the slowest decoder backward is): ``max vision + max language``,
      vision dealt by LPT alone. (d sync) starts from the better of (b)'s placement and one for the
      language work alone, and a step that gains nothing moves nothing (no exchange, no barrier):
      never worse than (b). The exchange's bytes: ``BYTES_PER_MOVED_PATCH`` per moved patch.

Work model, Qwen2.5-VL-7B (``testing.tiny_checkpoint.PRESETS``): an image's vision work is the
tower's forward FLOPs (``model.vision_flops.qwen2_5_vl``: linear layers, windowed attention, the 4
full-attention blocks' ``(h*w)^2`` term, the merger); a sample's language work is the decoder's
forward FLOPs over its real tokens (``train.flops.language_forward_flops``, attention's ``S^2``
included), times the language weight, divided by language tp on each GPU. Weights: 0 (vision only),
``comparable`` (the language weight that makes the mean GPU's language and vision work equal on this
data) and 1 (the 7B's own FLOPs: the decoder dominates). Backward is ~2x forward in both modules,
which scales every figure alike.

Data (``--mix``): ``documents`` is ``testing.demo_data``'s mix at real resolution -- 7% text-only
rows, 8% rows of 2-3 small images, 15% large pages (1600-4096 patches), 70% small images (36-400
patches); text tokens log-normal (median 250, long tail, capped at 8000; text-only rows median 600).
``multi-page`` makes 40% of the rows hold 2-6 images, each a large page with probability 0.3. Image
tokens (patches / 4 + 2 each) count as language tokens.

Layouts (8 GPUs): equal DP (language dp 8, images dp 8) and fan-in (language tp 2 x dp 4, images dp
8); 1, 2, 4, 8 samples per GPU (per vision slice). Figures are means over ``--trials`` micro-batches;
``(b) -> (d)``: the mean change of the heaviest GPU.

Usage: python scripts/bench_encoder_balance.py [--trials 300] [--seed 0] [--mix documents|multi-page|both]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from dataclasses import dataclass
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from mimo_sft.data.reorder.colocated_plan import ColocatedGrid, colocated_order, group_loads  # noqa: E402
from mimo_sft.model.vision_flops import qwen2_5_vl  # noqa: E402
from mimo_sft.testing.tiny_checkpoint import PRESETS  # noqa: E402
from mimo_sft.train.flops import language_forward_flops  # noqa: E402

PRESET = PRESETS["qwen2.5-vl-7b"]
VISION = SimpleNamespace(**PRESET["vision"])
TEXT = SimpleNamespace(**PRESET["text"])
MERGE = VISION.spatial_merge_size
#: What one moved patch costs on the wire (bf16 embeddings: 2 bytes a value):
#: pixels as the data path carries them (``model.pixels``: uint8 ``C*P*P``, the temporal tile is made on
#: the device), its share of a merged token's embedding out (``out_hidden / merge^2`` values), and
#: the same again for the embedding's gradient back.
PIXEL_BYTES = VISION.in_channels * VISION.patch_size ** 2
EMBED_BYTES = VISION.out_hidden_size * 2 // MERGE ** 2
BYTES_PER_MOVED_PATCH = PIXEL_BYTES + 2 * EMBED_BYTES

LAYOUTS = (("equal DP 8", ColocatedGrid(vision_dp=8, language_dp=8, language_tp=1)),
           ("fan-in tp2 x dp4, images dp8", ColocatedGrid(vision_dp=8, language_dp=4, language_tp=2)))
#: Row mixes: the share of text-only rows, of multi-image rows, their image count (inclusive) and the
#: chance that one of their images is a large page (single-image rows: 15 of every 85 are pages).
MIXES = {"documents": dict(text=0.07, multi=0.08, images=(2, 3), multi_large=0.0),
         "multi-page": dict(text=0.07, multi=0.40, images=(2, 6), multi_large=0.3)}


@dataclass
class Batch:
    """One micro-batch, per sample: its images' patches and vision FLOPs, its real tokens and language FLOPs."""

    image_patches: list[list[int]]
    image_flops: list[list[float]]
    tokens: np.ndarray
    language_flops: np.ndarray

    @property
    def patches(self) -> np.ndarray:
        return np.array([float(sum(p)) for p in self.image_patches])

    @property
    def vision_flops(self) -> np.ndarray:
        return np.array([math.fsum(f) for f in self.image_flops])


def _grid(rng: random.Random, large: bool) -> tuple[int, int, int]:
    """A patch grid: a large page 40-64 x 40-64 patches, a small image 6-20 x 6-20 (even sides: merge 2)."""
    lo, hi = (20, 32) if large else (3, 10)
    return 1, 2 * rng.randint(lo, hi), 2 * rng.randint(lo, hi)


def draw_sample(rng: random.Random, mix: dict) -> tuple[list[tuple[int, int, int]], int]:
    """``(image grids, text tokens)`` of one row of ``mix``."""
    r = rng.random()
    if r < mix["text"]:
        return [], min(8000, int(rng.lognormvariate(math.log(600), 1.0)) + 20)
    if r < mix["text"] + mix["multi"]:
        grids = [_grid(rng, rng.random() < mix["multi_large"]) for _ in range(rng.randint(*mix["images"]))]
    else:
        grids = [_grid(rng, rng.random() < 15 / 85)]  # 15% large pages, 70% small, of all rows
    return grids, min(8000, int(rng.lognormvariate(math.log(250), 1.0)) + 20)


def draw_batch(rng: random.Random, n: int, mix: dict) -> Batch:
    patches, flops, tokens = [], [], []
    for _ in range(n):
        grids, text = draw_sample(rng, mix)
        patches.append([t * h * w for t, h, w in grids])
        flops.append([qwen2_5_vl(VISION, [g]) for g in grids])
        tokens.append(text + sum(p // MERGE ** 2 + 2 for p in patches[-1]))
    lang = np.array([language_forward_flops(TEXT, [t]) for t in tokens])
    return Batch(patches, flops, np.array(tokens, dtype=np.float64), lang)


@dataclass(frozen=True)
class Calibration:
    """Mean FLOPs per patch and per token on a mix (the linear weights (b lin) plans with), and the
    language weight at which the mean GPU's language and vision FLOPs are equal."""

    per_patch: float
    per_token: float
    comparable: float


def calibrate(mix: dict, seed: int, n: int = 20000) -> Calibration:
    b = draw_batch(random.Random(seed), n, mix)
    v, lang = b.vision_flops.sum(), b.language_flops.sum()
    return Calibration(v / b.patches.sum(), lang / b.tokens.sum(), v / lang)


def encoder_lpt(language_loads, items, homes) -> tuple[np.ndarray, np.ndarray]:
    """Encoder-only balancing: ``items`` (vision work) dealt largest first onto the GPU group with the
    least language + vision load, a tie going to the item's ``homes`` group first, then the lowest index.
    Returns ``(loads, where)``: each group's load and each item's group; the home placement when LPT is
    not lighter."""
    lang = np.asarray(language_loads, dtype=np.float64)
    items = np.asarray(items, dtype=np.float64)
    homes = np.asarray(homes, dtype=np.int64)
    home_loads = lang + np.bincount(homes, weights=items, minlength=lang.size)
    loads = lang.copy()
    where = np.empty(items.size, dtype=np.int64)
    for i in sorted(range(items.size), key=lambda j: (-items[j], j)):
        g = int(homes[i]) if loads[homes[i]] <= loads.min() else int(np.argmin(loads))
        where[i] = g
        loads[g] += items[i]
    if loads.max() >= home_loads.max():
        return home_loads, homes.copy()
    return loads, where


def busiest_link_bytes(where, homes, patches, n_groups: int) -> float:
    """The most bytes one GPU group sends, or receives, for the moves ``homes -> where``: pixels go
    out to the encoding GPU, the embeddings come back, their gradients go out again."""
    moved = np.asarray(where) != np.asarray(homes)
    p = np.asarray(patches, dtype=np.float64) * moved
    out = np.bincount(np.asarray(homes), weights=p, minlength=n_groups)  # patches a group sends away
    into = np.bincount(np.asarray(where), weights=p, minlength=n_groups)  # patches it encodes for others
    sent = (PIXEL_BYTES + EMBED_BYTES) * out + EMBED_BYTES * into
    received = PIXEL_BYTES * into + EMBED_BYTES * out + EMBED_BYTES * into
    return float(max(sent.max(), received.max()))


def _encoder_only(batch: Batch, lang: np.ndarray, grid: ColocatedGrid, order, mean: float) -> dict[str, float]:
    """Encoder-only balancing on top of ``order``'s placement, its language loads fixed: heaviest GPU /
    ``mean`` without a barrier (``img``: whole images move; ``smp``: whole samples' vision work) and with
    the all-to-all as a barrier (``sync``), and the patches and busiest-GPU bytes the image variants move."""
    n, G = lang.size, grid.n_groups
    base = np.asarray(group_loads(np.zeros(n), lang, grid, order))  # language load of each GPU group
    home = np.empty(n, dtype=np.int64)
    home[np.asarray(order)] = np.arange(n) // (n // G)  # the vision group each sample is encoded on
    img_home = np.array([home[i] for i in range(n) for _ in batch.image_flops[i]], dtype=np.int64)
    img_cost = [f for fl in batch.image_flops for f in fl]
    img_patches = np.array([p for ps in batch.image_patches for p in ps], dtype=np.float64)
    # A GPU's decoder needs every image of its language slice encoded first (and their tower backward
    # follows its decoder backward), wherever they are encoded: no schedule of whole images ends a GPU
    # before its language load plus the largest such image.
    span = n // grid.language_dp
    largest = [max((f for i in order[r * span:(r + 1) * span] for f in batch.image_flops[i]), default=0.0)
               for r in range(grid.language_dp)]
    dep = base + np.array(largest)[np.arange(G) // (G // grid.language_dp)]
    out = {"lang": float(base.max()) / mean, "dep": max(1.0, float(dep.max()) / mean),
           "smp": float(encoder_lpt(base, batch.vision_flops, home)[0].max()) / mean}
    loads, where = encoder_lpt(base, img_cost, img_home)
    out.update(img=float(loads.max()) / mean, moved=float(img_patches[where != img_home].sum()),
               link=busiest_link_bytes(where, img_home, img_patches, G))
    # the all-to-all as a barrier: every GPU's language forward starts when the slowest tower is done
    # (and every tower's backward when the slowest language backward is): max vision + max language
    vision, where = encoder_lpt(np.zeros(G), img_cost, img_home)
    out.update(sync=(float(vision.max()) + float(base.max())) / mean,
               moved_sync=float(img_patches[where != img_home].sum()),
               link_sync=busiest_link_bytes(where, img_home, img_patches, G))
    return out


def step_figures(batch: Batch, grid: ColocatedGrid, language_weight: float, cal: Calibration) -> dict[str, float]:
    """One micro-batch: heaviest GPU over the mean GPU for each method of the module docstring, the mean
    GPU's forward FLOPs (``mean``), the patches the encoder-only variants move (``moved_*``) and the
    bytes their busiest GPU sends or receives (``link_*``)."""
    v = batch.vision_flops
    lang = language_weight * batch.language_flops / grid.language_tp
    G, n = grid.n_groups, v.size
    mean = (v.sum() + lang.sum() * (G // grid.language_dp)) / G  # a language slice's term is on G / dp groups
    ident = list(range(n))
    order_b = colocated_order(v, lang, grid)
    lin_order = colocated_order(cal.per_patch * batch.patches,
                                language_weight * cal.per_token * batch.tokens / grid.language_tp, grid)
    out = {"mean": mean}
    for key, order in (("a", ident), ("b", order_b), ("b_lin", lin_order)):
        out[key] = max(group_loads(v, lang, grid, order)) / mean
    c, d = _encoder_only(batch, lang, grid, ident, mean), _encoder_only(batch, lang, grid, order_b, mean)
    out.update(c_img=c["img"], c_smp=c["smp"], c_floor=max(1.0, c["lang"]), moved_d=d["moved"], link_d=d["link"],
               d_img=d["img"], d_smp=d["smp"], d_dep=d["dep"], c_sync=min(out["a"], c["sync"]))
    # (d sync): with a barrier the exchange spreads the vision work anyway, so the samples may as well be
    # placed for the language work alone -- the better of that and (b)'s placement; and a step that gains
    # nothing moves nothing (no exchange, no barrier): (b) itself.
    e = _encoder_only(batch, lang, grid, colocated_order(np.zeros(n), lang, grid), mean)
    best = min((out["b"], None), (d["sync"], d), (e["sync"], e), key=lambda t: t[0])
    out.update(d_sync=best[0], moved_d_sync=best[1]["moved_sync"] if best[1] else 0.0,
               link_d_sync=best[1]["link_sync"] if best[1] else 0.0)
    return out


WEIGHTS = (("0", None), ("comparable", "comparable"), ("1 (7B FLOPs)", 1.0))
#: Assumed rates for the exchange-over-step column: bf16 work per GPU, and one GPU's share of an
#: inter-node all-to-all (NVLink inside a node is several times faster).
ASSUMED_FLOPS, ASSUMED_LINK = 400e12, 50e9
TRAIN_FACTOR = 3  # forward + backward (2x forward) in both modules


def rows(mix_name: str, trials: int, seed: int, layouts=LAYOUTS, per_gpu=(1, 2, 4, 8), weights=WEIGHTS,
         calibration_samples: int = 20000):
    """Yield ``(layout name, samples per GPU, weight label, weight, means)`` for every row of a table:
    the means over ``trials`` micro-batches of :func:`step_figures`, of the vision share of the work
    (``share``), of the heaviest GPU's change from (b) to (d) (``cut``, ``cut_sync``), of the patches
    (``patches``; ``cut_dep``: (d) raised to its dependency floor) and of the busiest GPU's exchange
    time over the step time at the assumed rates."""
    mix = MIXES[mix_name]
    cal = calibrate(mix, seed + 7, calibration_samples)
    for name, grid in layouts:
        for per in per_gpu:
            for label, w in weights:
                w = 0.0 if w is None else cal.comparable if w == "comparable" else float(w)
                rng = random.Random(seed * 1_000_003 + per * 101 + grid.block * 7 + int(1000 * w))
                acc: dict[str, list[float]] = {}
                for _ in range(trials):
                    batch = draw_batch(rng, grid.n_groups * per, mix)
                    fig = step_figures(batch, grid, w, cal)
                    vis = batch.vision_flops.sum()
                    for key, top in (("d", "d_img"), ("d_sync", "d_sync")):
                        step_s = TRAIN_FACTOR * fig[top] * fig["mean"] / ASSUMED_FLOPS
                        fig[f"time_{key}"] = fig[f"link_{key}"] / ASSUMED_LINK / step_s
                    fig.update(share=vis / (vis + w * batch.language_flops.sum()), cut=fig["d_img"] / fig["b"] - 1,
                               cut_dep=max(fig["d_img"], fig["d_dep"]) / fig["b"] - 1,
                               cut_sync=fig["d_sync"] / fig["b"] - 1, patches=float(batch.patches.sum()))
                    for k, x in fig.items():
                        acc.setdefault(k, []).append(x)
                yield name, per, label, w, {k: statistics.fmean(x) for k, x in acc.items()}


def table(mix_name: str, trials: int, seed: int) -> None:
    print(f"\nmix {mix_name!r}, {trials} micro-batches per row: heaviest GPU / mean GPU (1 = perfect balance)")
    print("| layout | samples/GPU | language weight | vision share | (a) as read | (b) sample placement | (b lin) "
          "| (c) enc-only, images | (c) enc-only, samples | (c floor) | (d) both, images | (d) both, samples "
          "| (d dep floor) | (c sync) | (d sync) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    costs = []
    for name, per, label, w, m in rows(mix_name, trials, seed):
        if label == "comparable":
            label = f"comparable ({w:.3f})"
        print(f"| {name} | {per} | {label} | {m['share']:.2f} | {m['a']:.3f} | {m['b']:.3f} | {m['b_lin']:.3f} "
              f"| {m['c_img']:.3f} | {m['c_smp']:.3f} | {m['c_floor']:.3f} | {m['d_img']:.3f} | {m['d_smp']:.3f} "
              f"| {m['d_dep']:.3f} | {m['c_sync']:.3f} | {m['d_sync']:.3f} |")
        costs.append(f"| {name} | {per} | {label} | {100 * m['cut']:+.1f}% | {100 * m['cut_dep']:+.1f}% "
                     f"| {100 * m['cut_sync']:+.1f}% "
                     f"| {100 * m['moved_d'] / m['patches']:.0f}% | {m['moved_d'] * BYTES_PER_MOVED_PATCH / 1e6:.0f} "
                     f"| {m['link_d'] / 1e6:.1f} | {100 * m['time_d']:.2f}% "
                     f"| {m['moved_d_sync'] * BYTES_PER_MOVED_PATCH / 1e6:.0f} | {100 * m['time_d_sync']:.2f}% "
                     f"| {TRAIN_FACTOR * m['mean'] / 1e12:.1f} |")
    print(f"\nmix {mix_name!r}: what (d) gains over (b) and what it moves per step (exchange / step: the busiest "
          f"GPU's bytes at an assumed {ASSUMED_LINK / 1e9:.0f} GB/s over the step's heaviest GPU at "
          f"{ASSUMED_FLOPS / 1e12:.0f} TFLOP/s)")
    print("| layout | samples/GPU | language weight | heaviest GPU (b) -> (d) | (b) -> (d) or its dependency floor "
          "| (b) -> (d sync) | patches moved (d) "
          "| MB moved/step (d) | busiest GPU MB (d) | exchange / step (d) | MB moved/step (d sync) "
          "| exchange / step (d sync) | mean GPU TFLOP/step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(costs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", choices=(*MIXES, "both"), default="both")
    args = ap.parse_args()
    per_patch = qwen2_5_vl(VISION, [(1, 2, 2)]) / 4
    print(f"Qwen2.5-VL-7B. Bytes per moved patch (formula): pixels C*P*P = {VISION.in_channels}*{VISION.patch_size}^2 "
          f"= {PIXEL_BYTES} B (uint8, as the data path carries them; bf16 float patches C*T*P*P would be "
          f"{2 * VISION.in_channels * VISION.temporal_patch_size * VISION.patch_size ** 2} B) + embedding out "
          f"{VISION.out_hidden_size}*2 B / merge^2 = {EMBED_BYTES} B + its gradient back {EMBED_BYTES} B "
          f"= {BYTES_PER_MOVED_PATCH} B per moved patch; bytes/step = moved patches x {BYTES_PER_MOVED_PATCH} "
          f"(all GPUs together), against ~{per_patch / 1e9:.2f} GFLOP forward (x3 with backward) of tower "
          "work per patch.")
    for mix in (MIXES if args.mix == "both" else (args.mix,)):
        table(mix, args.trials, args.seed)


if __name__ == "__main__":
    main()
