"""The straggler report (issue 45 item 2, ``train.straggler``) without processes: the seconds each rank books per
phase (``mimo_sft.progress``), its work against its peers', the slowest rank and the phase its excess is in, the
warning after 3 intervals in a row, the block that rides in the existing all-reduce, and ``mimo-sft summarize``'s
table and plot. The real run that slows one rank on purpose is tests/test_streamed_e2e.py's two-node run."""

import json
import os
import subprocess
import sys
import time

import pytest

from mimo_sft.config.loader import load_config
from mimo_sft.parallel.components import parse_component
from mimo_sft.parallel.layout import Layout
from mimo_sft.progress import Progress
from mimo_sft.train.straggler import (PHASES, ROW, Flagger, StragglerReport, phase_row, ratios, roles, slowest,
                                      work_s)
from mimo_sft.validate import check_config

ROLES = [("language",), ("language",), ("images",), ("images",), ("images",)]


def _row(step=1.0, **phases):
    return phase_row(step, {k.replace("_", " "): v for k, v in phases.items()})


def _busy(phase: str, s: float) -> list[float]:
    """A 1 s step: ``s`` seconds in ``phase``, the rest waiting in the bridge."""
    return _row(1.0, **{phase: s, "bridge": 1.0 - s})


def test_progress_books_each_phase_and_a_nested_wait_apart():
    p = Progress()
    p.begin_step(1)
    p.enter("data wait")
    time.sleep(0.05)
    with p.nested("reorder wait"):
        time.sleep(0.1)
    assert p.phase == "data wait"  # the outer phase resumes
    time.sleep(0.05)
    p.leave("data wait")
    time.sleep(0.02)
    p.enter("encoder forward")
    s = p.take_seconds()
    assert s["reorder wait"] == pytest.approx(0.1, abs=0.03)
    assert s["data wait"] == pytest.approx(0.1, abs=0.03)  # before and after the nested wait
    assert s["compute"] >= 0.02 and p.phase == "encoder forward"
    p.begin_step(2)
    assert p.take_seconds().keys() <= {"compute"}  # a new step books from zero


def test_work_is_the_step_less_the_waits_on_other_ranks():
    row = _row(2.0, data_wait=0.3, bridge=0.9, gradient_finalize=0.2, reorder_wait=0.1, encoder_forward=0.5)
    assert len(row) == ROW and work_s(row) == pytest.approx(0.8)
    assert phase_row(1.0, {"evaluation": 0.4})[1 + PHASES.index("compute")] == 0.4  # unknown phases: compute


def test_the_slowest_rank_is_judged_against_its_peers_only():
    # rank 0, a language rank, works 3x as long as the encoder ranks: its role, not a straggler
    table = [_row(1.0, language_forward=0.6, bridge=0.1), _row(1.0, language_forward=0.62, bridge=0.08),
             _row(1.0, encoder_forward=0.2, bridge=0.8), _row(1.0, encoder_forward=0.2, data_wait=0.1, bridge=0.7),
             _row(1.0, encoder_forward=0.2, bridge=0.8)]
    r = ratios(table, ROLES)
    assert r[0] == pytest.approx(0.9 / 0.92) and r[3] == pytest.approx(1.5)
    s = slowest(table, ROLES)
    assert (s.rank, s.phase) == (3, "data wait") and s.excess == pytest.approx(0.5)
    assert s.phase_excess_s == pytest.approx(0.1)
    assert slowest(table, [("a",), ("b",), ("c",), ("d",), ("e",)]) is None  # nobody has peers


def test_roles_come_from_the_layout():
    layout = Layout.from_specs([parse_component(c) for c in ("language=dp=2", "images=dp=2,rank_offset=2")])
    assert roles(layout) == [("language",)] * 2 + [("images",)] * 2
    colocated = Layout.from_specs([parse_component(c) for c in ("language=dp=2", "images=dp=2")])
    assert roles(colocated) == [("images", "language")] * 2


def test_a_rank_is_flagged_once_after_three_intervals_above_the_threshold():
    flag = Flagger(1.5, ["n0", "n0", "n1", "n1", "n1"])
    slow = [_busy("language_forward", 0.5)] * 2 + [_busy("encoder_forward", 0.2)] * 2 + [_busy("encoder_forward", 0.4)]
    fine = [_busy("language_forward", 0.5)] * 2 + [_busy("encoder_forward", 0.2)] * 3
    assert flag.see(slow, ROLES, 1) == [] and flag.see(slow, ROLES, 2) == []
    (line,) = flag.see(slow, ROLES, 3)
    assert line.startswith("mimo-sft: warning: straggler: rank 4 on host n1 has worked 2.00x")
    assert "3 log intervals in a row up to step 3, most in encoder forward (+0.20 s/step)" in line
    assert flag.see(slow, ROLES, 4) == []  # said once
    assert flag.see(fine, ROLES, 5) == [] and [flag.see(slow, ROLES, s) for s in (6, 7)] == [[], []]
    assert len(flag.see(slow, ROLES, 8)) == 1  # a new streak of 3
    assert Flagger(2.5, ["h"] * 5).see(slow, ROLES, 1) == []


def test_the_block_rides_only_at_log_steps_and_is_analysed_on_the_metrics_rank(capsys):
    layout = Layout.from_specs([parse_component(c) for c in ("language=dp=2", "images=dp=2,rank_offset=2")])
    reports = [StragglerReport(rank=r, world_size=4, layout=layout, log_interval=2, total_steps=5, threshold=1.5,
                               hosts=["a", "a", "b", "b"]) for r in range(4)]
    block = [0.0] * (4 * ROW)
    for step in (1, 2):
        for r, rep in enumerate(reports):
            extra = 0.4 * step if r == 3 else 0.0  # rank 3's forward grows, its peers wait for it in the bridge
            rep.add(1.0, {"encoder forward" if r >= 2 else "language forward": 0.2 + extra, "bridge": 0.8 - extra})
            got = rep.figures(step)
            assert (got == []) == (step == 1)
            block = [a + b for a, b in zip(block, got)] if got else block
    out = reports[0].analyse(2, block)
    assert out["rank_step_s"] == [1.0] * 4 and out["rank_work_s"] == [0.2, 0.2, 0.2, 0.8]  # means of the 2 steps
    assert out["rank_phase_s"]["encoder forward"] == [0.0, 0.0, 0.2, 0.8]
    assert (out["slowest_rank"], out["slowest_phase"], out["slowest_excess"]) == (3, "encoder forward", 3.0)
    assert reports[0].figures(5) != [] and reports[0].figures(3) == []  # the last step is a log step too
    assert reports[0].analyse(3, []) == {} and capsys.readouterr().out == ""
    json.dumps(out)  # a metrics.jsonl row


def test_straggler_threshold_is_checked():
    problems = [p.message for p in check_config(load_config(["--straggler-threshold", "1"])).problems]
    assert any(p.startswith("--straggler-threshold=1.0 must be > 1") for p in problems), problems
    assert load_config([]).logging.straggler_threshold == 1.5


def test_summarize_prints_the_per_rank_table_and_writes_the_plot(tmp_path):
    from mimo_sft.summary import summarize

    rows = []
    for step in range(1, 7):
        rows.append({"step": step, "loss": 2.0 - step / 10, "step_time_s": 1.0, "tokens_per_s": 100.0,
                     "rank_step_s": [1.0, 1.0, 1.0], "rank_work_s": [0.3, 0.3, 0.9],
                     "rank_phase_s": {"data wait": [0.1, 0.1, 0.7], "optimizer": [0.2, 0.2, 0.2],
                                      "bridge": [0.7, 0.7, 0.1]},
                     "slowest_rank": 2, "slowest_excess": 2.0, "slowest_phase": "data wait"})
    rows.insert(3, {"step": 3, "valid_loss": 1.5, "valid_ppl": 4.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = summarize(str(tmp_path))
    assert lines[0].startswith("steps: 6   loss: 1.900 (mean of first 1) -> 1.400") and "falling" in lines[0]
    table = lines[lines.index(next(ln for ln in lines if ln.startswith(" rank"))) + 1:][:3]
    assert table[2].split() == ["2", "1.000", "0.900", "0.100", "data", "wait", "0.700", "6/6"], table
    assert table[0].split()[-1] == "0/6"
    png = tmp_path / "rank_spread.png"
    assert not png.exists() and f"plot of the spread of work per step: add --png (writes {png})" in lines  # asked only
    assert f"spread of work per step over the run: {png}" in summarize(str(tmp_path), png="")
    assert png.read_bytes()[:4] == b"\x89PNG"
    def python_m(args):  # the command imports no torch: a fresh interpreter is quick
        return subprocess.run([sys.executable, "-m", "mimo_sft", *args], capture_output=True, text=True, timeout=120)

    proc = python_m(["summarize", str(tmp_path), "--png-path", str(tmp_path / "spread.png")])
    assert proc.returncode == 0 and proc.stdout.splitlines() == [*lines[:-2], f"spread of work per step over the run: "
                                                                 f"{tmp_path / 'spread.png'}", lines[-1]], proc.stderr
    os.remove(png)
    proc = python_m(["summarize", str(tmp_path), "--png"])
    assert proc.returncode == 0 and f"spread of work per step over the run: {png}" in proc.stdout and png.exists()
    os.remove(tmp_path / "metrics.jsonl")
    proc = python_m(["summarize", str(tmp_path)])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'metrics.jsonl'} not found: the fine-tune did not log any step (give the run's "
        f"--output-dir)"]


def test_summarize_says_where_the_layout_changed_and_keeps_the_layouts_apart(tmp_path):
    """Issue 55 item 7: steps 1-4 on 2 ranks (per-rank figures every 2 steps), resumed on 1 rank for steps 5-8.
    The loss covers every step; speed and memory only the last layout's, said in a line; no 2-rank table."""
    from mimo_sft.summary import summarize

    rows = []
    for step in range(1, 9):
        two = step <= 4
        row = {"step": step, "loss": 2.0 - step / 10, "step_time_s": 1.0 if two else 3.0, "tokens_per_s": 100.0,
               "peak_memory_bytes_language": (1 if two else 3) * 2**30, "world_size": 2 if two else 1}
        if two and step % 2 == 0:
            row.update({"rank_step_s": [1.0, 1.0], "rank_work_s": [0.5, 0.9],
                        "rank_phase_s": {"optimizer": [0.5, 0.9], "bridge": [0.5, 0.1]}, "slowest_rank": 1})
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = summarize(str(tmp_path))
    assert lines[0].startswith("steps: 8   loss: 1.900 (mean of first 1) -> 1.200")
    assert lines[1] == ("the layout changed: steps 1-4 on 2 ranks, steps 5-8 on 1 rank; speed, memory and per-rank "
                        "figures below are of steps 5-8 on 1 rank")
    assert lines[2].startswith("mean step time 3.000 s")  # steps 6-8, not a mean over both layouts
    assert "language 3.00" in next(ln for ln in lines if ln.startswith("peak memory"))
    assert "no per-rank figures" in lines[-2]
    # rows logged before world_size: the per-rank figures still tell 2 ranks from 3; a row without them continues
    from mimo_sft.summary import layout_spans

    old = [{"step": 1}, {"step": 2, "rank_work_s": [1, 1]}, {"step": 3}, {"step": 4, "rank_work_s": [1, 1, 1]}]
    assert layout_spans(old) == [(1, 3, 2), (4, 4, 3)]


def test_the_peers_median_of_a_large_world_agrees_with_the_plain_definition():
    """ratios() sorts each role once (O(n log n)); against the median of every rank's peers, computed plainly."""
    import random
    import statistics

    rng = random.Random(3)
    for n in (2, 3, 4, 9, 64):
        role = [("a",) if rng.random() < 0.5 else ("b",) for _ in range(n)]
        table = [_row(1.0, encoder_forward=round(rng.random(), 1), bridge=0.0) for _ in range(n)]  # with ties
        work = [work_s(row) for row in table]
        plain = {}
        for r in range(n):
            peers = [work[q] for q in range(n) if q != r and role[q] == role[r]]
            if peers and statistics.median(peers) > 0:
                plain[r] = work[r] / statistics.median(peers)
        assert ratios(table, role) == pytest.approx(plain), n
