"""A two-source mixture end to end (torchrun, gloo, CPU): per-source metrics that add up to the
logged ones, per-source validation, and a resume that continues the same global sample order --
bit for bit on the same layout, to the reduction order (relative 1e-5) on 2 ranks after 4."""

from __future__ import annotations

import functools
import json
import math
import os

import pytest

from e2e_runs import NON_COLOCATED_4, assert_continues, finetune
from train_helpers import metrics, new_dir

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e_mixture")]

FLAGS = ["--seq-length", "160", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--dataloader-type", "cyclic", "--seed", "7",
         "--no-tensorboard", "--scalable-dp", "--intra-microbatch-reorder", "--train-iters", "4", "--save-interval", "2", "--eval-iters", "1"]
TWO = ["language=dp=1", "images=dp=1,rank_offset=1"]


@functools.lru_cache(maxsize=None)
def _sources() -> list[str]:
    """A large source (48 rows) and a small one (6 rows, repeated within the run), each with a
    validation set of its own."""
    from mimo_sft.testing.demo_data import write_demo_dataset

    root = new_dir("mixture_data")
    return [str(write_demo_dataset(os.path.join(root, name), samples=n, seed=seed))
            for name, n, seed in (("docs.parquet", 48, 1), ("chat.parquet", 6, 2), ("docs_valid.parquet", 4, 3),
                                  ("chat_valid.parquet", 4, 4))]


def _mix_flags(load=None) -> list[str]:
    docs, chat, docs_valid, chat_valid = _sources()
    return [*FLAGS, "--dataset-path", chat, "--dataset-weights", "0.7,0.3",
            "--valid-dataset-path", docs_valid, "--valid-dataset-path", chat_valid,
            *(["--load-checkpoint", load] if load else [])]


@functools.lru_cache(maxsize=None)
def _continuous():
    # finetune passes --dataset-path DATA first: docs is the first source, chat (from _mix_flags) the second
    return finetune("mixture_cont", 4, _mix_flags(), components=NON_COLOCATED_4, data=_sources()[0])


def _rows(run_dir):
    return [m for m in metrics(run_dir) if "loss" in m], [m for m in metrics(run_dir) if "valid_loss" in m]


def test_per_source_losses_weighted_by_tokens_sum_to_the_logged_loss():
    run = _continuous()
    # 4 steps of 8: docs is read 0.7 * 32 / 48 times, chat 0.3 * 32 / 6 (issue 42 item 6)
    assert ("mimo-sft: data mixture: docs 48 rows (70.0%, read 0.47 times), chat 6 rows (30.0%, read 1.60 times)"
            in run.proc.stdout)
    train, valid = _rows(run.out)
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    from mimo_sft.data.mixture import MixtureOrder

    drawn = MixtureOrder([48, 6], [0.7, 0.3], seed=7, shuffle=True).draws_before(32)
    assert [train[-1]["epochs/docs"], train[-1]["epochs/chat"]] == [round(drawn[0] / 48, 6), round(drawn[1] / 6, 6)]
    for m in train:
        tokens = [m["tokens/docs"], m["tokens/chat"]]
        assert sum(tokens) == m["supervised_tokens"]
        assert m["samples/docs"] + m["samples/chat"] == 8
        weighted = sum(m[f"loss/{n}"] * m[f"tokens/{n}"] for n in ("docs", "chat") if f"loss/{n}" in m)
        assert math.isclose(weighted / m["supervised_tokens"], m["loss"], rel_tol=1e-6), m
    # 32 samples drawn at 0.7/0.3: both sources drawn, the 6-row source more than its rows (it repeats)
    drawn = {n: sum(m[f"samples/{n}"] for m in train) for n in ("docs", "chat")}
    assert drawn["chat"] > 6 and drawn["docs"] > drawn["chat"], drawn
    (last,) = valid
    assert last["valid_tokens/docs"] > 0 and last["valid_tokens/chat"] > 0
    weighted = sum(last[f"valid_loss/{n}"] * last[f"valid_tokens/{n}"] for n in ("docs", "chat"))
    assert math.isclose(weighted / last["valid_tokens"], last["valid_loss"], rel_tol=1e-6)
    meta = json.load(open(os.path.join(run.out, "checkpoints", "iter_0000002", "meta.json")))
    assert meta["mixture"] == {"names": ["docs", "chat"], "rows": [48, 6], "shares": [0.7, 0.3], "interleave": "deficit"}
    assert [s["name"] for s in meta["data_order"]["sources"]] == ["docs", "chat"]


def test_a_resumed_mixture_continues_the_same_global_order():
    cont = _continuous().out
    ckpt = cont + "/checkpoints/iter_0000002"
    same = finetune("mixture_resumed", 4, _mix_flags(ckpt), components=NON_COLOCATED_4, data=_sources()[0])
    a = {m["step"]: m for m in _rows(cont)[0]}
    b = {m["step"]: m for m in _rows(same.out)[0]}
    assert sorted(b) == [3, 4]
    for step in b:  # same layout: bit for bit, per source too
        assert {k: v for k, v in b[step].items() if k.startswith(("loss", "grad_norm", "samples/", "tokens/"))} == \
            {k: v for k, v in a[step].items() if k.startswith(("loss", "grad_norm", "samples/", "tokens/"))}, step
    two = finetune("mixture_two", 2, _mix_flags(ckpt), components=TWO, data=_sources()[0])
    diffs = assert_continues(cont, two.out, [3, 4])
    c = {m["step"]: m for m in _rows(two.out)[0]}
    for step in (3, 4):  # the same samples of each source on 2 ranks
        assert [c[step][f"samples/{n}"] for n in ("docs", "chat")] == [a[step][f"samples/{n}"] for n in ("docs", "chat")]
    print(f"4 -> 2 ranks: relative loss differences {diffs}")
    # another weight: refused before any process starts, naming the flags
    other = [f if f != "0.7,0.3" else "0.5,0.5" for f in _mix_flags(ckpt)]
    refused = finetune("mixture_refused", 4, other, components=NON_COLOCATED_4, data=_sources()[0], check=False)
    assert refused.proc.returncode != 0 and "the dataset mixture differs from the checkpoint's" in \
        refused.proc.stdout + refused.proc.stderr


def test_evaluate_reports_each_sources_validation_loss():
    """``mimo-sft evaluate`` on the last checkpoint with a validation set per source gives what the
    run's own evaluation after step 4 logged, per source too."""
    from train_helpers import tiny_model, torchrun

    run = _continuous()
    docs, _chat, docs_valid, chat_valid = _sources()
    (logged,) = _rows(run.out)[1]
    proc = torchrun(4, [os.path.join(run.out, "checkpoints", "iter_0000004"), "--hf-model", tiny_model(),
                        "--dataset-path", docs, "--dataset-path", _sources()[1], "--dataset-weights", "0.7,0.3",
                        "--valid-dataset-path", docs_valid, "--valid-dataset-path", chat_valid, *FLAGS, "--json",
                        *[x for c in NON_COLOCATED_4 for x in ("--component", c)]], command="evaluate")
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    got = json.loads(line)
    assert math.isclose(got["loss"], logged["valid_loss"], rel_tol=1e-6)
    for name in ("docs", "chat"):
        assert math.isclose(got["sources"][name]["loss"], logged[f"valid_loss/{name}"], rel_tol=1e-6), name
        assert got["sources"][name]["tokens"] == logged[f"valid_tokens/{name}"]
