"""--reorder-calibrate-from RUN: the cost weights from a run's measured phases (config.calibration).

The metrics rows are the straggler report's own (``train.straggler.StragglerReport.analyse`` on a gathered
block), filled from a known truth: encoder seconds = fixed + a * patches, language seconds = fixed + b * tokens
(with noise). The fit must find ``b / a``; the config, the banner and config.yaml must carry the weights.
"""

import json
import random

import pytest

from mimo_sft.config.calibration import Fit, calibrate, fit
from mimo_sft.config.loader import dump_config, load_config
from mimo_sft.errors import UserError
from mimo_sft.parallel.components import parse_component
from mimo_sft.parallel.layout import Layout
from mimo_sft.train.straggler import PHASES, ROW, StragglerReport

A, B = 3e-5, 1e-5  # seconds per patch, per token (over language tp)


def _write_run(folder, *, intervals=6, seed=0, loads=True) -> str:
    """A colocated 2-rank run's metrics.jsonl: one straggler row per log interval, plus plain step rows."""
    rng = random.Random(seed)
    layout = Layout.from_specs([parse_component("language=dp=2"), parse_component("images=dp=2")])
    report = StragglerReport(rank=0, world_size=2, layout=layout, log_interval=1, total_steps=intervals,
                             threshold=10.0, hosts=["h0", "h1"])
    rows = []
    for step in range(1, intervals + 1):
        block = []
        for _ in range(2):
            patches, tokens = rng.uniform(2000, 9000), rng.uniform(500, 3000)
            row = [0.0] * ROW
            row[1 + PHASES.index("encoder forward")] = 0.6 * (0.004 + A * patches) * rng.uniform(0.98, 1.02)
            row[1 + PHASES.index("encoder backward")] = 0.4 * (0.004 + A * patches) * rng.uniform(0.98, 1.02)
            row[1 + PHASES.index("language forward")] = 0.5 * (0.002 + B * tokens) * rng.uniform(0.98, 1.02)
            row[1 + PHASES.index("language backward")] = 0.5 * (0.002 + B * tokens) * rng.uniform(0.98, 1.02)
            row[0] = sum(row[1:1 + len(PHASES)]) + 0.01
            if loads:
                row[1 + len(PHASES):] = [patches, tokens]
            block += row
        out = report.analyse(step, block)
        if not loads:
            out = {k: v for k, v in out.items() if k not in ("rank_patches", "rank_tokens")}
        rows.append({"step": step, "loss": 1.0, **out})
        rows.append({"step": step, "loss": 1.0})  # a row without the block (not a log step)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        fh.write('{"step": 99, "cut')  # a killed run's last line
    return str(folder)


def test_fit_finds_slope_and_fixed_part_and_falls_back_on_flat_load():
    rng = random.Random(1)
    xs = [rng.uniform(1000, 5000) for _ in range(50)]
    got = fit(xs, [0.01 + 2e-5 * x + rng.gauss(0, 2e-4) for x in xs])
    assert got.per_unit_s == pytest.approx(2e-5, rel=0.02) and got.fixed_s == pytest.approx(0.01, abs=2e-3)
    assert got.r2 > 0.9
    flat = fit([100.0, 100.0, 100.0], [1.0, 1.1, 0.9])  # nothing varies: the ratio of the sums
    assert flat == Fit(per_unit_s=pytest.approx(0.01), fixed_s=0.0, points=3, r2=None)
    assert fit([0.0, 0.0], [1.0, 2.0]) is None


def test_calibration_recovers_the_measured_ratio(tmp_path):
    c = calibrate(_write_run(tmp_path / "run"))
    assert c.encoder.points == 12 and c.language.points == 12
    assert c.encoder.per_unit_s == pytest.approx(A, rel=0.05)
    assert c.language.per_unit_s == pytest.approx(B, rel=0.05)
    assert c.language_weight == pytest.approx(B / A, rel=0.08)
    assert "language weight" in c.describe() and "us/patch" in c.describe()


def test_config_takes_the_calibrated_weights_and_keeps_them_not_the_folder(tmp_path):
    run = _write_run(tmp_path / "run")
    cfg = load_config(["--reorder-calibrate-from", run, "--reorder-language-cost-weight", "7"])
    r = cfg.reorder
    assert r.encoder_cost_weight == 1.0 and r.language_cost_weight == pytest.approx(B / A, rel=0.08)
    assert r.calibrate_from is None and r.calibration.startswith(f"calibrated from {run}")
    # config.yaml (and so a resumed run) holds the numbers: growing metrics cannot change a resumed plan
    text = dump_config(cfg)
    assert "calibrate_from" in text and run in text
    (tmp_path / "config.yaml").write_text(text)
    again = load_config(["--config", str(tmp_path / "config.yaml")])
    assert again.reorder.language_cost_weight == r.language_cost_weight and again.reorder.calibration == r.calibration


def test_a_folder_without_figures_is_one_line_naming_the_flag(tmp_path):
    with pytest.raises(UserError, match=r"--reorder-calibrate-from .*no metrics.jsonl"):
        load_config(["--reorder-calibrate-from", str(tmp_path / "nothing")])
    old = _write_run(tmp_path / "old", loads=False)  # a run from before the work figures were logged
    with pytest.raises(UserError, match=r"--reorder-calibrate-from .*no encoder phases with patches"):
        load_config(["--reorder-calibrate-from", old])
