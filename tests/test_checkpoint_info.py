"""Check 24 (checkpoint writing, and whether --load-checkpoint resumes on this layout), check 35 (whether
a resume's flags keep the saved data order) and ``mimo-sft checkpoint info``: unit tests, no processes.

The checkpoints here are folders with the ``meta.json`` a save writes (the resharding rule reads
only that); ``checkpoint info`` on a real checkpoint written by a run is tested in
test_checkpoint_kill.py (the full-disk test, which leaves one behind).
"""

import json
import os
import subprocess
import sys

import pytest

from mimo_sft.validate import check_config
from mimo_sft.config.checks.checkpoint import reshard_problem
from mimo_sft.config.loader import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = [{"name": "language", "dp": 2, "tp": 1, "pp": 1, "cp": 1, "etp": 1, "rank_offset": 0},
         {"name": "images", "dp": 2, "tp": 1, "pp": 1, "cp": 1, "etp": 1, "rank_offset": 2}]


def _checkpoint(tmp_path, fmt):
    """A run's checkpoint folder (root with ``latest``) whose meta.json says how it was saved."""
    root = tmp_path / "checkpoints"
    (root / "iter_0000004").mkdir(parents=True)
    meta = {"step": 4, "consumed_samples": 32, "world_size": 4, "layout": SAVED, "dtype": "fp32",
            "use_distributed_optimizer": fmt is not None, **({"distributed_optimizer_format": fmt} if fmt else {})}
    (root / "iter_0000004" / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text("iter_0000004\n")
    return str(root)


def _problems(args):
    res = check_config(load_config(args))
    return [str(p) for p in res.problems if p.check == 24], [str(n) for n in res.notes if n.check == 24]


def _layout(*components):
    return [a for c in components for a in ("--component", c)] + ["--micro-batch-size", "4", "--global-batch-size", "8"]


def test_a_dp_only_checkpoint_is_refused_on_another_tp_and_resumes_on_another_dp(tmp_path):
    ckpt = _checkpoint(tmp_path, "dp_reshardable")
    tp2 = _layout("language=tp=2,dp=1", "images=dp=2")
    problems, _ = _problems(tp2 + ["--load-checkpoint", ckpt, "--use-distributed-optimizer"])
    assert len(problems) == 1 and "saved in the DP-only form with language tp=1,pp=1" in problems[0]
    assert "this layout has tp=2,pp=1" in problems[0] and "--save-reshardable" in problems[0]
    # another DP size, colocated: fine
    dp1 = _layout("language=dp=2", "images=dp=2")
    assert _problems(dp1 + ["--load-checkpoint", ckpt, "--use-distributed-optimizer"])[0] == []


@pytest.mark.parametrize("fmt", [None, "fully_reshardable", "fully_reshardable_boxes"])
def test_a_reshardable_checkpoint_resumes_on_any_layout(tmp_path, fmt):
    """(None: a plain optimizer's.) megatron's gathered form is noted: megatron-core 0.19.2 stores it shifted
    past a module's first gradient bucket (test_checkpoint_scale.py)."""
    ckpt = _checkpoint(tmp_path, fmt)
    for comps in (("language=tp=2,dp=1", "images=dp=2"), ("language=pp=2,dp=1", "images=dp=2,rank_offset=2")):
        problems, notes = _problems(_layout(*comps) + ["--load-checkpoint", ckpt])
        assert problems == []
        shifted = [n for n in notes if "written by megatron's gather" in n]
        assert len(shifted) == (fmt == "fully_reshardable"), notes
        assert all("--pretrained-checkpoint" in n for n in shifted)
        assert reshard_problem(json.load(open(os.path.join(ckpt, "iter_0000004", "meta.json"))), []) is None


def test_checkpoint_writing_notes():
    _, notes = _problems(_layout("language=dp=2", "images=dp=2") + ["--async-save", "--save-reshardable",
                                                                    "--no-use-distributed-optimizer"])
    assert any("--async-save without --save-interval" in n for n in notes)
    assert any("--save-reshardable has no effect without the distributed optimizer" in n for n in notes)
    _, notes = _problems(_layout("language=dp=2", "images=dp=2") + ["--async-save", "--save-interval", "2",
                                                                    "--save-reshardable", "--use-distributed-optimizer"])
    assert notes == []
    # LoRA keeps the plain optimizer: nothing to reshard, and its checkpoints name no distributed format
    _, notes = _problems(_layout("language=dp=2", "images=dp=2") + ["--save-interval", "2", "--save-reshardable",
                                                                    "--use-distributed-optimizer", "--lora-rank", "8"])
    assert any("--save-reshardable has no effect with LoRA" in n for n in notes)
    from mimo_sft.train.checkpoint.optimizer import save_format

    assert save_format(load_config(_layout("language=dp=2", "images=dp=2") + ["--lora-rank", "8"])) is None
    assert save_format(load_config(_layout("language=dp=2", "images=dp=2"))) == "dp_reshardable"
    assert save_format(load_config(_layout("language=dp=2", "images=dp=2") + ["--save-reshardable"])) == \
        "fully_reshardable_boxes"


def _info(*args):
    return subprocess.run([sys.executable, "-m", "mimo_sft", "checkpoint", "info", *args], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def test_checkpoint_info_answers_whether_it_resumes_on_a_layout(tmp_path):
    ckpt = _checkpoint(tmp_path, "dp_reshardable")
    ok = _info(ckpt, "--component", "language=dp=1", "--component", "images=dp=1,rank_offset=1", "--json")
    assert ok.returncode == 0, ok.stderr
    info = json.loads(ok.stdout)
    assert info["step"] == 4 and info["optimizer"] == "distributed" and info["resumes_on"]["ok"]
    assert info["distributed_optimizer_format"] == "dp_reshardable" and info["modules"] == {}
    no = _info(ckpt, "--component", "language=tp=2,dp=1", "--component", "images=dp=2")
    assert no.returncode == 1 and "resume on language=tp=2" in no.stdout and "no: its distributed-optimizer" in no.stdout
    missing = _info(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error: checkpoint") and "Traceback" not in missing.stderr


def _saved_order(tmp_path, **order):
    """A checkpoint whose meta.json records the data-order settings ``order`` (``None``: an older
    checkpoint that recorded none)."""
    ckpt = _checkpoint(tmp_path, None)
    meta_path = os.path.join(ckpt, "iter_0000004", "meta.json")
    meta = json.load(open(meta_path))
    if order:
        meta["data_order"] = {"micro_batch_size": 4, "global_batch_size": 8, "seed": 1234, "dataloader_type": "single",
                              "drop_last": True, **order}
    json.dump(meta, open(meta_path, "w"))
    return ckpt


def _order_problems(ckpt, *flags):
    args = ["--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--load-checkpoint", ckpt, *flags]
    res = check_config(load_config(args))
    return [str(p) for p in res.problems if p.check == 35], [str(p) for p in res.problems if p.check != 35]


def test_a_resume_with_another_micro_batch_size_is_refused_naming_the_flag(tmp_path):
    ckpt = _saved_order(tmp_path, micro_batch_size=2)
    mine, _ = _order_problems(ckpt)
    assert mine == [f"[35] --micro-batch-size 4 differs from the checkpoint's 2 (an epoch holds whole micro-batches, "
                    f"so its data position would name other samples): resume with --micro-batch-size 2, or start "
                    f"from its weights with --pretrained-checkpoint {ckpt} instead of --load-checkpoint"]
    # the same settings pass; another global batch size keeps the order (it changes samples per step only)
    assert _order_problems(_saved_order(tmp_path / "same", micro_batch_size=4)) == ([], [])
    assert _order_problems(_saved_order(tmp_path / "gbs", global_batch_size=16)) == ([], [])


def test_a_resume_that_changes_the_sample_order_is_refused(tmp_path):
    ckpt = _saved_order(tmp_path, dataloader_type="cyclic", seed=7, drop_last=False)
    mine, _ = _order_problems(ckpt)
    assert len(mine) == 2, mine
    assert mine[0].startswith("[35] --drop-last differs from the checkpoint's --no-drop-last") and \
        "resume with --no-drop-last, or start from its weights" in mine[0]
    assert mine[1].startswith("[35] --dataloader-type single differs from the checkpoint's cyclic") and \
        "resume with --dataloader-type cyclic," in mine[1]
    # cyclic shuffles with the seed: another seed is refused, the saved one passes
    mine, _ = _order_problems(ckpt, "--dataloader-type", "cyclic", "--no-drop-last")
    assert mine == [f"[35] --seed 1234 differs from the checkpoint's 7 (--dataloader-type cyclic shuffles each epoch "
                    f"with it): resume with --seed 7, or start from its weights with --pretrained-checkpoint {ckpt} "
                    f"instead of --load-checkpoint"]
    assert _order_problems(ckpt, "--dataloader-type", "cyclic", "--no-drop-last", "--seed", "7")[0] == []
    # in order and without a held-out split the seed does not touch the data: passes; with --valid-split it does
    single = _saved_order(tmp_path / "single", seed=7)
    assert _order_problems(single)[0] == []
    mine, _ = _order_problems(single, "--valid-split", "4")
    assert len(mine) == 1 and "--seed 1234 differs from the checkpoint's 7 (--valid-split holds out rows chosen" in mine[0]


def test_a_resume_recognises_its_sources_by_resolved_path_and_position_not_spelling_or_name(tmp_path, monkeypatch):
    """Issue 42 item 4: the same files given as ./data/a.jsonl or by absolute path, or renamed in YAML, are the
    checkpoint's mixture; a changed share or another file is refused naming the source and what differs."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a", "b", "c"):
        (data / f"{name}.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    saved = [{"name": "a", "path": "./data/a.jsonl", "share": 0.75}, {"name": "b", "path": "data/b.jsonl", "share": 0.25}]
    ckpt = _saved_order(tmp_path / "ck", sources=saved)
    absolute = ["--dataset-path", str(data / "a.jsonl"), "--dataset-path", str(data / "b.jsonl"),
                "--dataset-weights", "3,1"]
    assert _order_problems(ckpt, *absolute) == ([], [])
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text("data:\n  datasets:\n    - {path: ./data/a.jsonl, weight: 3, name: docs}\n"
                       "    - {path: data/../data/b.jsonl, weight: 1, name: web}\n")
    assert _order_problems(ckpt, "--config", str(renamed)) == ([], [])
    mine, _ = _order_problems(ckpt, "--dataset-path", "data/a.jsonl", "--dataset-path", "data/c.jsonl",
                              "--dataset-weights", "1,1")
    assert len(mine) == 1, mine
    assert f"source 2 (c) was data/b.jsonl, now {data / 'c.jsonl'}" in mine[0]
    assert "source 1 (a) had share 0.75, now 0.5" in mine[0] and "source 2 (c) had share 0.25, now 0.5" in mine[0]


def test_a_checkpoint_without_recorded_data_order_is_unknown_not_a_mismatch(tmp_path):
    old = _saved_order(tmp_path)  # meta.json as saved before data_order was recorded
    assert "data_order" not in json.load(open(os.path.join(old, "iter_0000004", "meta.json")))
    assert _order_problems(old, "--micro-batch-size", "8", "--global-batch-size", "16", "--seed", "3",
                           "--dataloader-type", "cyclic")[0] == []


def test_a_save_records_the_settings_check_35_compares():
    from mimo_sft.config.checks.checkpoint import data_order_meta

    cfg = load_config(["--micro-batch-size", "2", "--global-batch-size", "6", "--seed", "5", "--dataloader-type",
                       "cyclic", "--no-drop-last"])
    assert data_order_meta(cfg) == {"data_order": {"micro_batch_size": 2, "global_batch_size": 6, "seed": 5,
                                                   "dataloader_type": "cyclic", "drop_last": False}}


def test_checkpoint_info_shows_the_mixture_and_each_sources_position():
    """Issue 42 item 6: the sources, shares, rows and samples drawn of each (the interleave's count at the
    checkpoint's consumed samples), and the DP-only form's rule for an expert-parallel checkpoint."""
    from mimo_sft.data.mixture import MixtureOrder
    from mimo_sft.train.checkpoint.info import _resume_rule, _sources

    meta = {"consumed_samples": 96, "mixture": {"names": ["docs", "web"], "rows": [4, 1000], "shares": [0.75, 0.25],
                                                "interleave": "deficit"},
            "data_order": {"seed": 3, "sources": [{"name": "docs", "path": "/d", "share": 0.75},
                                                  {"name": "web", "path": "/w", "share": 0.25}]}}
    got = _sources(meta)
    assert [(s["name"], s["rows"], s["drawn"]) for s in got] == [("docs", 4, 72), ("web", 1000, 24)]
    assert got[0]["epochs"] == 18.0
    old = _sources({**meta, "mixture": {k: v for k, v in meta["mixture"].items() if k != "interleave"}})
    shuffled = MixtureOrder([4, 1000], [0.75, 0.25], seed=3, shuffle=False, interleave="shuffled").draws_before(96)
    assert [s["drawn"] for s in old] == shuffled
    assert _sources({"consumed_samples": 8}) == []
    ep2 = [{"name": "language", "tp": 1, "pp": 1, "ep": 2, "etp": 1}]
    assert _resume_rule("dp_reshardable", ep2) == "any DP size; TP, PP, EP and expert TP as saved"
    assert _resume_rule("dp_reshardable", SAVED) == "any DP size; TP and PP as saved"
    assert _resume_rule("fully_reshardable_boxes", ep2) == "any layout"
