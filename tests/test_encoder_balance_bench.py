"""``scripts/bench_encoder_balance.py`` (issue 46): its figures on hand-made micro-batches whose answers are
worked out here, and the orderings every row must keep (the docs' verdict rests on them)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from mimo_sft.data.reorder.colocated_plan import ColocatedGrid, group_loads

_spec = importlib.util.spec_from_file_location(
    "bench_encoder_balance", Path(__file__).resolve().parents[1] / "scripts" / "bench_encoder_balance.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

CAL = bench.Calibration(per_patch=1.0, per_token=1.0, comparable=1.0)
EQUAL_2 = ColocatedGrid(vision_dp=2, language_dp=2, language_tp=1)


def _batch(images: list[list[float]], language: list[float]) -> "bench.Batch":
    """Samples whose images cost their patch count and whose language work is given (tokens alike)."""
    return bench.Batch([[int(f) for f in fl] for fl in images], [list(map(float, fl)) for fl in images],
                       np.array(language, dtype=np.float64), np.array(language, dtype=np.float64))


def test_a_two_image_row_beside_a_text_row_is_split_only_by_moving_an_image():
    # GPU 0 encodes two images of 100 patches, GPU 1 none: no sample placement helps (one sample each),
    # moving one image halves the heaviest GPU; its bytes: 100 patches of pixels + embeddings + gradients.
    fig = bench.step_figures(_batch([[100, 100], []], [0, 0]), EQUAL_2, 0.0, CAL)
    assert fig["mean"] == 100
    assert fig["a"] == fig["b"] == fig["c_smp"] == fig["d_smp"] == 2.0
    assert fig["c_img"] == fig["d_img"] == fig["c_sync"] == fig["d_sync"] == 1.0
    assert fig["moved_d"] == 100
    # the sender: pixels out, gradients out; the encoder: embeddings out
    assert fig["link_d"] == 100 * (3 * 14 * 14 + 3584 * 2 // 4)
    assert bench.BYTES_PER_MOVED_PATCH == 3 * 14 * 14 + 2 * 3584 * 2 // 4



def test_lpt_deals_largest_first_prefers_home_and_keeps_a_better_layout():
    loads, where = bench.encoder_lpt([0, 0], [1, 1, 2], [0, 0, 0])  # 2 stays home, both 1s go: 2 | 2
    assert loads.tolist() == [2, 2] and where.tolist() == [1, 1, 0]
    loads, where = bench.encoder_lpt([0, 0], [2, 1], [1, 1])  # a tie keeps the 2 home: one image moves, not two
    assert loads.tolist() == [1, 2] and where.tolist() == [1, 0]
    loads, where = bench.encoder_lpt([0, 5], [3, 2], [1, 0])  # the language load counts: 5 | 5
    assert loads.tolist() == [5, 5] and where.tolist() == [0, 0]
    # home is 3 + 3 | 2 + 2 + 2 = 6 | 6; LPT would end 5 | 7: the layout stays, nothing moves
    loads, where = bench.encoder_lpt([0, 0], [3, 3, 2, 2, 2], [0, 0, 1, 1, 1])
    assert loads.tolist() == [6, 6] and where.tolist() == [0, 0, 1, 1, 1]


def test_busiest_link_counts_pixels_and_gradients_out_embeddings_back():
    pix, emb = 3 * 14 * 14, 3584 * 2 // 4
    # GPU 0 sends 100 patches to each of GPUs 1 and 2: it sends pixels and gradients of 200 patches
    assert bench.busiest_link_bytes([1, 2], [0, 0], [100, 100], 3) == 200 * (pix + emb)
    # GPUs 1 and 2 each send 100 to GPU 0: it receives their pixels and gradients
    assert bench.busiest_link_bytes([0, 0], [1, 2], [100, 100], 3) == 200 * (pix + emb)
    assert bench.busiest_link_bytes([0, 1], [0, 1], [100, 100], 3) == 0

def test_the_barrier_keeps_vision_from_hiding_behind_light_language_work():
    # GPU 0: images 6 + 6, no language; GPU 1: language 8. Without a barrier nothing beats the layout
    # (moving a 6 makes 14); with one, vision 6 | 6 then language 8: 14 too -- (c sync) keeps the layout.
    fig = bench.step_figures(_batch([[6, 6], []], [0, 8]), EQUAL_2, 1.0, CAL)
    assert fig["a"] == pytest.approx(1.2) and fig["c_img"] == pytest.approx(1.2)
    assert fig["c_sync"] == pytest.approx(1.2) and fig["moved_d_sync"] == 0
    # language 2 on both: vision 6 | 6 + language 2 is 8 = the mean, either way
    fig = bench.step_figures(_batch([[6, 6], []], [2, 2]), EQUAL_2, 1.0, CAL)
    assert fig["a"] == pytest.approx(14 / 8)
    assert fig["c_img"] == pytest.approx(1.0) and fig["c_sync"] == pytest.approx(1.0)
    # images 6 + 4 on GPU 0, language 3 on GPU 1 (mean 6.5): the 4 moves; without a barrier 6 | 4 + 3,
    # with one the decoder waits for the slowest tower: 6 + 3
    fig = bench.step_figures(_batch([[6, 4], []], [0, 3]), EQUAL_2, 1.0, CAL)
    assert fig["c_img"] == pytest.approx(7 / 6.5) and fig["c_sync"] == pytest.approx(9 / 6.5)


def test_the_dependency_floor_catches_a_move_that_cannot_help():
    # GPU 0: an image 10 and language 5; GPU 1: nothing (mean 7.5). LPT moves the image to GPU 1 and
    # counts 5 | 10, but GPU 0's decoder waits for that image wherever it is encoded: 10 + 5 still
    fig = bench.step_figures(_batch([[10], []], [5, 0]), EQUAL_2, 1.0, CAL)
    assert fig["a"] == fig["b"] == 2.0
    assert fig["d_img"] == pytest.approx(10 / 7.5) and fig["d_dep"] == 2.0


@pytest.mark.parametrize("name,grid", bench.LAYOUTS)
def test_every_row_keeps_the_orderings_on_drawn_batches(name, grid):
    rng = random.Random(3)
    for per in (1, 2):
        for _ in range(6):
            batch = bench.draw_batch(rng, grid.n_groups * per, bench.MIXES["multi-page"])
            v = batch.vision_flops
            for w in (0.0, 0.2, 1.0):
                fig = bench.step_figures(batch, grid, w, CAL)
                lang = w * batch.language_flops / grid.language_tp
                assert sum(group_loads(v, lang, grid)) / grid.n_groups == pytest.approx(fig["mean"], rel=1e-12)
                eps = 1e-9
                for key in ("a", "b", "b_lin", "c_img", "c_smp", "d_img", "d_smp", "c_sync", "d_sync"):
                    assert fig[key] >= 1 - eps, (key, fig)
                # nothing may come out worse than the layout it started from; the language load stays put
                assert fig["b"] <= fig["a"] + eps and fig["c_img"] <= fig["a"] + eps
                assert fig["d_img"] <= fig["b"] + eps and fig["d_sync"] <= fig["b"] + eps
                assert fig["c_img"] >= fig["c_floor"] - eps
                # the dependency floor of (b)'s placement: a GPU's language plus an image (b) also counts
                assert 1 <= fig["d_dep"] <= fig["b"] + eps
                # Graham's bound with the language loads as start times: the image that lands last on the
                # heaviest GPU went to the least-loaded one, at most the mean: so at most the mean plus the
                # largest image, unless that GPU's language load alone is the heaviest
                largest = max((f for fl in batch.image_flops for f in fl), default=0.0) / fig["mean"]
                assert fig["c_img"] <= max(fig["c_floor"], 1 + largest) + eps

def test_rows_yield_every_layout_and_weight():
    out = list(bench.rows("documents", 2, 0, per_gpu=(1,), calibration_samples=500))
    assert [(r[0], r[2]) for r in out] == [(name, label) for name, _ in bench.LAYOUTS for label, _ in bench.WEIGHTS]
    for *_, m in out:
        assert 0 < m["share"] <= 1 and m["b"] <= m["a"] + 1e-9
