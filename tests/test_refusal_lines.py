"""A refused config is said once, by rank 0, even when another rank fails its checks first: that rank
holds its exit (torchrun stops every rank once one exits, and would cut rank 0 off before its lines),
and says the problems itself, naming its rank, only when rank 0 did not fail meanwhile. Found in CI:
rank 3 left first and the user saw only four exit codes."""

from __future__ import annotations

import json

from mimo_sft.errors import UserError
from mimo_sft.train import launch


def _refused(rank, monkeypatch, capsys):
    slept = []
    monkeypatch.setattr(launch.time, "sleep", slept.append)
    launch._refuse(rank, UserError("two problems", problems=["--a is wrong; set --a 2", "--b is wrong; drop it"]))
    return capsys.readouterr().err, slept


def test_rank_0_says_the_problems_at_once(monkeypatch, capsys):
    monkeypatch.delenv("MIMO_SFT_ERROR_DIR", raising=False)
    err, slept = _refused(0, monkeypatch, capsys)
    assert err == "error: --a is wrong; set --a 2\nerror: --b is wrong; drop it\n" and slept == []


def test_another_rank_waits_for_rank_0_then_says_them_with_its_rank(monkeypatch, capsys):
    monkeypatch.delenv("MIMO_SFT_ERROR_DIR", raising=False)
    err, slept = _refused(3, monkeypatch, capsys)
    assert slept == [launch.REFUSAL_HOLD_S] and launch.REFUSAL_HOLD_S >= 5
    assert err.splitlines() == ["error: [rank 3] --a is wrong; set --a 2", "error: [rank 3] --b is wrong; drop it"]


def test_under_mimo_sfts_launcher_every_rank_records_its_lines(monkeypatch, capsys, tmp_path):
    from mimo_sft.train.elastic import ERROR_DIR_ENV, first_failure

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    err, slept = _refused(3, monkeypatch, capsys)
    assert err == "" and slept == []
    got = first_failure(str(tmp_path))
    assert got["rank"] == 3 and got["code"] == 2 and "--b is wrong" in got["line"]
    assert json.loads((tmp_path / "rank_00003.json").read_text())["line"].startswith("error: --a is wrong")
