"""The hang watchdog (issue 45 item 1, ``train.watchdog``): a rank stopped on purpose (a fault hook only tests
set) ends the run within --hang-timeout plus 30 s, with one line naming the stuck rank and where the others wait,
every rank's stack in OUTPUT_DIR/hang/, and exit code 75 (requeue). The naming rule is tested without processes."""

import os
import time

import pytest

from train_helpers import demo_data, new_dir, python_m, tiny_model

from mimo_sft.config.loader import load_config
from mimo_sft.train.watchdog import HANG_EXIT_CODE, behind, hang_timeout_s
from mimo_sft.validate import check_config


def _beat(rank, step, phase, published=100.0):
    return {"rank": rank, "host": "h", "step": step, "microbatch": 1, "phase": phase, "published": published}


def test_the_stuck_rank_is_the_one_the_others_wait_for():
    now = 110.0
    # same step: the rank in its own data wait holds up the one in the bridge
    assert behind({0: _beat(0, 2, "bridge"), 1: _beat(1, 2, "data wait")}, now, 30)[:2] == ([1], [])
    # an earlier step is behind whatever its phase
    assert behind({0: _beat(0, 3, "gradient finalize"), 1: _beat(1, 2, "bridge"), 2: _beat(2, 3, "bridge")},
                  now, 30)[:2] == ([1], [])
    # a rank that stopped publishing is frozen or dead
    assert behind({0: _beat(0, 2, "bridge"), 1: _beat(1, 2, "bridge", published=10.0)}, now, 30)[:2] == ([], [1])
    # everyone in the same collective: nobody to name
    assert behind({0: _beat(0, 2, "bridge"), 1: _beat(1, 2, "gradient finalize")}, now, 30) == ([], [], None)
    stuck, _, waiting = behind({0: _beat(0, 2, "gradient finalize"), 1: _beat(1, 2, "compute after data wait")}, now, 30)
    assert stuck == [1] and waiting["rank"] == 0


def test_the_timeout_in_force_and_its_checks():
    assert hang_timeout_s(0, [1.0] * 9, 600) == float("inf")
    assert hang_timeout_s(10, [0.1] * 3, 600) == 10  # explicit, after the first step
    assert hang_timeout_s(10, [], 600) == 540  # the first step (warm-up) gets the default's floor
    assert hang_timeout_s(-1, [0.1] * 9, 1800) == 600 and hang_timeout_s(-1, [60.0] * 9, 1800) == 1200
    assert hang_timeout_s(-1, [0.1] * 9, 300) == 240  # never closer than a minute to --dist-timeout
    for flags, says in ((["--hang-timeout", "590"], "not shorter than --dist-timeout 600 by 30 s"),
                        (["--hang-timeout", "-5"], "must be >= 1 seconds (or 0: no watchdog)")):
        problems = [p.message for p in check_config(load_config(flags)).problems]
        assert any(says in p for p in problems), problems
    assert not [p for p in check_config(load_config(["--hang-timeout", "60"])).problems if "hang" in p.message]


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["non_colocated", "colocated"])
def test_a_stuck_rank_is_named_dumped_and_the_run_exits_75(layout):
    components = {"non_colocated": ["language=dp=1", "images=dp=1,rank_offset=1"],
                  "colocated": ["language=dp=2", "images=dp=2"]}[layout]
    out = new_dir(f"hang_{layout}")
    args = ["finetune", "--nproc-per-node", "2", "--hf-model", tiny_model(), "--dataset-path", demo_data(),
            "--seq-length", "160", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--no-save", "--no-tensorboard", "--output-dir", out, "--hang-timeout", "10", "--dist-timeout", "120",
            *[a for c in components for a in ("--component", c)]]
    t0 = time.monotonic()
    proc = python_m(args, real=True, env={**os.environ, "MIMO_SFT_TEST_HANG_AT": "1:2"}, timeout=300)
    took = time.monotonic() - t0
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "rank 1 (" in errors[0] and "is in data wait of step 2" in errors[0] and "rank(s) 0 wait for them" in errors[0]
    dumps = {r: open(os.path.join(out, "hang", f"rank_{r}.txt")).read() for r in (0, 1)}
    assert "phase: data wait" in dumps[1] and "in enter" in dumps[1] and "time.sleep(3600)" in dumps[1]
    assert "step 2" in dumps[0] and "--- thread MainThread ---" in dumps[0]
    assert took < 150, took  # start-up, one step, the 10 s timeout and the report; not --dist-timeout's 120 s


def test_inside_its_own_phase_is_more_suspect_than_computing_after_one():
    """Colocated: the peer of a rank stuck in its data wait waits in a parameter gather no phase names."""
    stuck, _, waiting = behind({0: _beat(0, 2, "compute after data wait"), 1: _beat(1, 2, "data wait")}, 110.0, 30)
    assert stuck == [1] and waiting["rank"] == 0
