"""Dataset mixtures: the weighted interleave (shares, one order for every DP size, per-source
epochs, resume), the mixture's settings (flags, YAML, the bad-input lines) and its loading."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from mimo_sft.validate import check_config
from mimo_sft.config.loader import load_config
from mimo_sft.config.mixture import mixture_specs
from mimo_sft.data.mixture import MixtureOrder, MixtureSource, check_resumed_mixture
from mimo_sft.data.sampler import CanonicalSampler
from mimo_sft.errors import UserError


def _shares(sizes, weights, n=10_000, shuffle=False, seed=3):
    total = sum(weights)
    order = MixtureOrder(sizes, [w / total for w in weights], seed=seed, shuffle=shuffle)
    offsets = order.offsets
    counts = Counter(next(s for s in range(len(sizes)) if i < offsets[s + 1]) for i in order.indices(0, n))
    return [counts[s] / n for s in range(len(sizes))], order


@pytest.mark.parametrize("sizes,weights", [([50, 7000], [0.7, 0.3]), ([13, 400, 5000], [0.5, 0.3, 0.2]),
                                           ([100, 100, 100], [1, 1, 2])])
def test_drawn_shares_are_within_2_percent_of_the_weights_over_10k_samples(sizes, weights):
    for shuffle in (False, True):
        got, _ = _shares(sizes, weights, shuffle=shuffle)
        for g, w in zip(got, weights):
            assert abs(g - w / sum(weights)) < 0.02, (got, weights)
    # a stretch starting mid-stream too (not just from position 0)
    order = MixtureOrder(sizes, [w / sum(weights) for w in weights], seed=9, shuffle=True)
    idx = order.indices(123_457, 133_457)
    counts = Counter(next(s for s in range(len(sizes)) if i < order.offsets[s + 1]) for i in idx)
    assert all(abs(counts[s] / 10_000 - w / sum(weights)) < 0.02 for s, w in enumerate(weights))


def test_per_source_epochs_a_small_source_repeats_and_a_large_one_does_not_restart():
    _, order = _shares([10, 100_000], [0.5, 0.5], n=1)
    small, large = [], []
    for i in order.indices(0, 4000):
        (small if i < 10 else large).append(i)
    # single: the small source reads rows 0..9 again and again; the large one reads on, never restarts
    assert small[:30] == list(range(10)) * 3 and len(small) > 1500
    assert large == list(range(10, 10 + len(large)))
    # cyclic: every epoch of the small source is a permutation of its rows, and they differ
    order = MixtureOrder([10, 100_000], [0.5, 0.5], seed=3, shuffle=True)
    small = [i for i in order.indices(0, 4000) if i < 10]
    epochs = [small[k: k + 10] for k in range(0, 50, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs) and len({tuple(e) for e in epochs}) > 1
    large = [i for i in order.indices(0, 4000) if i >= 10]
    assert len(set(large)) == len(large)  # no repeat inside the large source's first epoch


def test_the_interleave_depends_on_shares_not_on_the_row_counts():
    a = MixtureOrder([10, 20], [0.6, 0.4], seed=1, shuffle=False)
    b = MixtureOrder([999, 5], [0.6, 0.4], seed=1, shuffle=False)
    assert [a.locate(p)[0] for p in range(3000)] == [b.locate(p)[0] for p in range(3000)]
    # the deficit rule needs no seed (rows inside a source still shuffle with it: cyclic); the older shuffled
    # chunks, which checkpoints written before it resume with, follow the seed
    c = MixtureOrder([10, 20], [0.6, 0.4], seed=2, shuffle=False)
    assert [a.locate(p)[0] for p in range(3000)] == [c.locate(p)[0] for p in range(3000)]
    old = [MixtureOrder([10, 20], [0.6, 0.4], seed=k, shuffle=False, interleave="shuffled") for k in (1, 2)]
    assert [old[0].locate(p)[0] for p in range(3000)] != [old[1].locate(p)[0] for p in range(3000)]
    assert [old[0].locate(p)[0] for p in range(3000)] != [a.locate(p)[0] for p in range(3000)]
    # draws served before a position: what a streaming source would resume at
    p = 2500
    assert a.draws_before(p) == [sum(1 for q in range(p) if a.locate(q)[0] == s) for s in range(2)]


def _worst_prefix_error(order, shares, start: int, stop: int) -> float:
    """max over prefixes [start, p) of |draws of s - share_s * (p - start)|, over sources."""
    counts, worst = np.zeros(len(shares)), 0.0
    for n, p in enumerate(range(start, stop), 1):
        counts[order.locate(p)[0]] += 1
        worst = max(worst, float(np.abs(counts - np.asarray(shares) * n).max()))
    return worst


def test_every_prefix_holds_each_source_within_one_sample_of_its_share():
    """Issue 42 item 7: 0.75/0.25 drew 0.66/0.34 over its first 96 samples with the shuffled chunks; the deficit
    rule keeps every prefix (from the start, or from a chunk boundary: a resume) within one sample, for two to
    five sources with random weights, including shares too small for one draw per 1024."""
    first = MixtureOrder([50, 50], [0.75, 0.25], seed=0, shuffle=False)
    assert Counter(first.locate(p)[0] for p in range(96)) == {0: 72, 1: 24}
    # shares that are small fractions are the chunk's quotas exactly: within one sample of the weights for good
    for shares in ([0.9, 0.1], [0.4, 0.3, 0.15, 0.1, 0.05], [1 / 3, 1 / 3, 1 / 3]):
        order = MixtureOrder([7] * len(shares), shares, seed=0, shuffle=False)
        assert order.chunk <= 60 and _worst_prefix_error(order, shares, 0, 20_000) < 1.0, shares
    rng = np.random.default_rng(0)
    for _case in range(12):
        k = int(rng.integers(2, 6))
        weights = rng.random(k) ** 3 + 1e-4
        shares = list(weights / weights.sum())
        order = MixtureOrder([7] * k, shares, seed=0, shuffle=False)
        # the rule's bound is on the quota shares (quota / chunk); they differ from the weights by < 1/chunk
        quota_shares = [q / order.chunk for q in order.quota]
        assert _worst_prefix_error(order, quota_shares, 0, 2 * order.chunk + 77) < 1.0, shares
        assert _worst_prefix_error(order, quota_shares, order.chunk, order.chunk + 500) < 1.0, shares
    old = MixtureOrder([50, 50], [0.75, 0.25], seed=0, shuffle=False, interleave="shuffled")
    assert _worst_prefix_error(old, [0.75, 0.25], 0, 1024) > 3  # what the shuffled chunks allowed


def test_a_checkpoint_written_before_the_deficit_rule_resumes_on_the_shuffled_chunks():
    from mimo_sft.data.mixture import resumed_interleave

    mix = MixtureSource([list("abc"), list("defgh")], ["x", "y"], [0.5, 0.5])
    assert mix.fingerprint()["interleave"] == "deficit" and resumed_interleave(mix.fingerprint()) == "deficit"
    old = {k: v for k, v in mix.fingerprint().items() if k != "interleave"}
    assert resumed_interleave(old) == "shuffled" and resumed_interleave(None) is None
    with pytest.raises(UserError, match="interleaved by 'zigzag'"):
        resumed_interleave({**old, "interleave": "zigzag"})


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_dp_size_reads_the_same_global_order_and_a_resume_continues_it(shuffle):
    order_kw = dict(sizes=[7, 30, 300], shares=[0.5, 0.3, 0.2], seed=5, shuffle=shuffle)
    mbs, grid, steps = 8, 4, 40

    def stream(dp, consumed=0):
        per_rank = []
        for r in range(dp):
            s = CanonicalSampler(337, micro_batch_size=mbs, canonical_grid=grid, dp_size=dp, dp_rank=r,
                                 consumed_samples=consumed, order=MixtureOrder(**order_kw))
            it = iter(s)
            per_rank.append([next(it) for _ in range(steps)])
        return [sum((per_rank[r][k] for r in range(dp)), []) for k in range(steps)]

    one = stream(1)
    assert stream(2) == one and stream(4) == one
    assert stream(2, consumed=16 * mbs)[: steps - 16] == one[16:]
    assert stream(4, consumed=16 * mbs)[: steps - 16] == one[16:]
    whole = CanonicalSampler(337, micro_batch_size=mbs, canonical_grid=grid, dp_size=2, dp_rank=1,
                             order=MixtureOrder(**order_kw), whole_micro_batch=True)
    assert whole.global_micro_batch(3) == one[3] and next(iter(whole)) == one[0]


def test_mixture_source_maps_global_indices_to_its_sources():
    mix = MixtureSource([list("abc"), list("defgh")], ["x", "y"], [0.5, 0.5])
    assert len(mix) == 8 and mix[0] == "a" and mix[3] == "d" and mix[7] == "h"
    import torch

    assert mix.source_of(torch.tensor([0, 2, 3, 7])).tolist() == [0, 0, 1, 1]
    assert mix.next_index(2) == 0 and mix.next_index(7) == 3  # a stand-in stays in its source
    assert mix.fingerprint() == {"names": ["x", "y"], "rows": [3, 5], "shares": [0.5, 0.5], "interleave": "deficit"}
    check_resumed_mixture(mix.fingerprint(), mix, checkpoint="ck")
    check_resumed_mixture({**mix.fingerprint(), "names": ["docs", "web"]}, mix, checkpoint="ck")  # renamed: same data
    with pytest.raises(UserError, match=r"row counts differ"):
        check_resumed_mixture({**mix.fingerprint(), "rows": [3, 6]}, mix, checkpoint="ck")
    with pytest.raises(UserError, match=r"trained on one --dataset-path"):
        check_resumed_mixture(None, mix, checkpoint="ck")


# --------------------------------------------------------------------------- settings

def test_repeated_dataset_path_flags_make_a_weighted_mixture(tmp_path):
    cfg = load_config(["--dataset-path", "a/one.parquet", "--dataset-path", "b/two", "--dataset-path", "c/one.jsonl",
                       "--dataset-weights", "0.5,0.3,0.2", "--valid-dataset-path", "va.parquet",
                       "--valid-dataset-path", "vb.parquet", "--valid-dataset-path", "vc.parquet"])
    assert cfg.data.dataset_path is None and [e["path"] for e in cfg.data.datasets] == ["a/one.parquet", "b/two",
                                                                                        "c/one.jsonl"]
    specs = mixture_specs(cfg.data)
    assert [s.name for s in specs] == ["one", "two", "one-2"]
    assert [round(s.weight, 6) for s in specs] == [0.5, 0.3, 0.2]
    assert [s.data.dataset_path for s in specs] == ["a/one.parquet", "b/two", "c/one.jsonl"]
    assert [s.data.valid_dataset_path for s in specs] == ["va.parquet", "vb.parquet", "vc.parquet"]
    # one --dataset-path stays the plain single source
    plain = load_config(["--dataset-path", "a.parquet"]).data
    assert plain.dataset_path == "a.parquet" and plain.datasets == [] and mixture_specs(plain) is None


def test_yaml_sources_with_per_source_keys(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("data:\n  images_column: pics\n  datasets:\n"
                 "    - {path: a.parquet, weight: 3, name: docs, images_column: imgs, split: train}\n"
                 "    - {path: b.jsonl, weight: 1, schema: sharegpt}\n")
    specs = mixture_specs(load_config(["--config", str(y)]).data)
    assert [(s.name, s.weight) for s in specs] == [("docs", 0.75), ("b", 0.25)]
    assert specs[0].data.images_column == "imgs" and specs[1].data.images_column == "pics"
    assert specs[1].data.schema == "sharegpt" and specs[0].data.schema == "auto"


def _c17(args):
    res = check_config(load_config(args))
    return [str(p) for p in res.problems if p.check == 17]


@pytest.mark.parametrize("weights,line", [
    ("0.5,-0.1", "[17] source 'b' (b.parquet): weight -0.1 is negative or not finite; give a weight >= 0"),
    ("0,0", "[17] --dataset-weights: every weight is 0 (source 'a' (a.parquet), source 'b' (b.parquet)); give at "
            "least one source a weight > 0"),
    ("0.5,0.3,0.2", "[17] --dataset-weights 0.5,0.3,0.2: 3 weights for 2 sources (a.parquet, b.parquet); give one "
                    "weight per source"),
    ("0.5,x", "[17] --dataset-weights 0.5,x: 'x' is not a number; give one weight per --dataset-path, e.g. "
              "0.5,0.3,0.2"),
])
def test_bad_weights_are_one_line_each_naming_the_source(tmp_path, weights, line):
    for name in ("a", "b"):
        (tmp_path / f"{name}.parquet").write_text("")
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        mine = _c17(["--dataset-path", "a.parquet", "--dataset-path", "b.parquet", "--dataset-weights", weights])
    finally:
        os.chdir(cwd)
    assert mine == [line]


def test_missing_sources_and_count_mismatches_are_named(tmp_path):
    mine = _c17(["--dataset-path", str(tmp_path / "a.parquet"), "--dataset-path", str(tmp_path / "b.parquet")])
    assert mine == [f"[17] source 'a': {tmp_path / 'a.parquet'} not found; give a parquet/json/jsonl file or folder",
                    f"[17] source 'b': {tmp_path / 'b.parquet'} not found; give a parquet/json/jsonl file or folder"]
    with pytest.raises(UserError, match=r"--valid-dataset-path is given 2 times for 3 training sources"):
        load_config(["--dataset-path", "a", "--dataset-path", "b", "--dataset-path", "c",
                     "--valid-dataset-path", "x", "--valid-dataset-path", "y"])
    y = tmp_path / "c.yaml"
    y.write_text("data:\n  datasets:\n    - {path: a.parquet, wieght: 2}\n")
    assert _c17(["--config", str(y)])[0] == ("[17] data.datasets[0]: unknown key 'wieght' (did you mean 'weight'?); "
                                             "keys: path, weight, name, "
                                             "valid_path, split, schema, messages_column, images_column, "
                                             "conversations_column, image_root, valid_dataset_split, streaming")


def test_an_empty_source_is_refused_naming_it(tmp_path):
    from mimo_sft.data.sources import load_sft_dataset

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    (tmp_path / "full.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "empty.jsonl").write_text("")
    cfg = load_config(["--dataset-path", str(tmp_path / "full.jsonl"), "--dataset-path", str(tmp_path / "empty.jsonl")])
    with pytest.raises(UserError) as err:
        load_sft_dataset(cfg.data)
    assert str(err.value).startswith("source 'empty': ") and "\n" not in str(err.value)
    ok = load_sft_dataset(load_config(["--dataset-path", str(tmp_path / "full.jsonl"),
                                       "--dataset-path", str(tmp_path / "full.jsonl")]).data)
    assert isinstance(ok, MixtureSource) and ok.names == ["full", "full-2"] and len(ok) == 6 and ok[4] == ok[1]


def test_the_loss_is_attributed_to_each_rows_source_padded_and_packed():
    import torch

    from mimo_sft.train.step import _language_loss

    losses = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [6.0, 7.0, 8.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    rows = torch.tensor([1, 0, 1])
    padded = rows[:, None].expand(3, 4).reshape(-1)
    total, count, rep = _language_loss(mask, losses, token_sources=padded, n_sources=2)
    assert rep["source_loss_and_tokens"].tolist() == [[9.0, 28.0], [2.0, 5.0]]
    assert float(total) == 37.0 and int(count) == 7
    # packed [1, T] with a pad segment in the overflow bin (2)
    packed_loss = torch.tensor([[2.0, 3.0, 4.0, 5.0, 1.0]])
    packed_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]])
    _t, _c, rep = _language_loss(packed_mask, packed_loss, token_sources=torch.tensor([1, 1, 0, 0, 2]), n_sources=2)
    assert rep["source_loss_and_tokens"].tolist() == [[4.0, 5.0], [1.0, 2.0]]
    # a shard of other length (context parallelism) is not attributed rather than attributed wrongly
    assert "source_loss_and_tokens" not in _language_loss(mask, losses, token_sources=rows, n_sources=2)[2]


def test_a_mixture_holds_out_validation_rows_per_source_and_reads_them_round_robin(tmp_path):
    import torch

    from mimo_sft.data.mixture import InterleavedView
    from mimo_sft.data.validation import split_sources

    def rows(tag, n):
        return [{"messages": [{"role": "user", "content": f"{tag}{i}"}, {"role": "assistant", "content": "ok"}]}
                for i in range(n)]

    for tag, n in (("a", 20), ("b", 6)):
        (tmp_path / f"{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(tag, n)))
    cfg = load_config(["--dataset-path", str(tmp_path / "a.jsonl"), "--dataset-path", str(tmp_path / "b.jsonl"),
                       "--valid-split", "2"])
    train, valid = split_sources(cfg.data, seed=1, global_batch_size=8)
    assert isinstance(train, MixtureSource) and train.sizes == [18, 4] and isinstance(valid, InterleavedView)
    assert len(valid) == 4 and valid.source_of(torch.arange(4)).tolist() == [0, 1, 0, 1]
    held = {valid[i][0][0]["content"][0]["text"] for i in range(4)}
    seen = {train[i][0][0]["content"][0]["text"] for i in range(len(train))}
    assert not held & seen and len(held | seen) == 26


def test_per_source_validation_losses_reach_tensorboard(tmp_path):
    """A mixture's ``valid_loss/<name>`` rows are TensorBoard scalars too (``valid/loss/<name>``)."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mimo_sft.train.metrics import MetricsLogger

    row = {"step": 3, "valid_loss": 2.0, "valid_ppl": 7.39, "valid_loss/docs": 1.5, "valid_loss/chat": 3.0,
           "valid_tokens/docs": 20.0, "valid_tokens/chat": 10.0}
    result = SimpleNamespace(to_json=lambda: row, step=3, valid_loss=2.0, valid_ppl=7.39, valid_tokens=30.0,
                             valid_samples=4, valid_time_s=0.1)
    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=3, tensorboard=True)
    logger.log_validation(result)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"valid/loss", "valid/loss/docs", "valid/loss/chat", "valid/tokens/docs"} <= tags, tags
    assert events.Scalars("valid/loss/chat")[0].value == 3.0


def test_source_names_are_readable_and_error_lines_stay_short(tmp_path):
    """Issue 42 item 5: derived names keep letters of any script and name a glob by its folder; YAML names
    win (made key-safe only); a mixture is named by its sources, never None; a huge weight list is not
    echoed whole."""
    from mimo_sft.config.mixture import _stem, dataset_label

    assert [_stem(p) for p in ("shard-*.tar", "/data/web/shard-*.tar", "dócs 1.jsonl", "/a/train.parquet",
                               "/a/folder/")] == ["shard", "web", "dócs_1", "train", "folder"]
    y = tmp_path / "mix.yaml"
    y.write_text("data:\n  datasets:\n    - {path: a.parquet, name: Dokumente 2024}\n    - {path: /w/shard-*.tar}\n")
    cfg = load_config(["--config", str(y)])
    assert [s.name for s in mixture_specs(cfg.data)] == ["Dokumente_2024", "w"]
    assert dataset_label(cfg.data) == "Dokumente_2024=a.parquet, w=/w/shard-*.tar"
    weights = ",".join(["1"] * 20_000)
    line = _c17(["--dataset-path", str(tmp_path / "a.parquet"), "--dataset-path", str(tmp_path / "b.parquet"),
                 "--dataset-weights", weights])
    assert any("20000 weights for 2 sources" in p for p in line) and max(len(p) for p in line) < 600, line


def test_validate_and_the_banner_say_how_often_each_source_is_read(tmp_path):
    """Issue 42 item 6: a 4-row source at weight 0.9 is read 27 times in 30 steps of 4: validate says so per
    source (share, streamed or loaded, rows where it opened them), and so do the banner and the metrics."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mimo_sft.config.mixture import source_lines

    (tmp_path / "shards").mkdir()
    rows = [json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])] * 4
    pq.write_table(pa.table({"messages": rows}), tmp_path / "shards" / "train-00000.parquet")
    (tmp_path / "chat.jsonl").write_text("")
    cfg = load_config(["--dataset-path", str(tmp_path / "shards"), "--dataset-path", str(tmp_path / "chat.jsonl"),
                       "--dataset-weights", "0.9,0.1", "--train-iters", "30", "--global-batch-size", "4",
                       "--micro-batch-size", "4"])
    lines = source_lines(cfg, {"shards": 4})
    assert lines[0] == (f"source 'shards' ({tmp_path / 'shards'}): 90.0% of the samples (~108 draws), loaded; 4 rows, "
                        f"read 27.00 times over --train-iters 30")
    assert lines[1].endswith("10.0% of the samples (~12 draws), loaded; rows not counted by validate (check-data "
                             "counts them)")
    notes = [str(n) for n in check_config(cfg).notes if n.check == 17]
    # a loaded parquet's rows are counted from its footer (issue 55 item 2); a JSON file's are not (no footer)
    assert len(notes) == 2 and notes[0] == f"[17] {lines[0]}" and notes[1] == f"[17] {lines[1]}", notes
    mix = MixtureSource([list("abcd"), list(range(48))], ["small", "big"], [0.9, 0.1])
    assert mix.rows_text(120) == "small 4 rows (90.0%, read 27.00 times), big 48 rows (10.0%, read 0.25 times)"
    order = mix.order(seed=0, shuffle=False)
    assert mix.epochs(order, 12) == [d / r for d, r in zip(order.draws_before(12), [4, 48])]
    assert sum(order.draws_before(12)) == 12
