"""Validation set rules without processes: check 28, the held-out split, the reader's shards and
fillers, the refusals before step 0, and the ``best`` checkpoint's retention."""

import dataclasses
import json
import os

import pytest
import torch

from data_fixtures import demo_dataset_dir, tiny_checkpoint_dir
from mimo_sft.validate import check_config
from mimo_sft.config.loader import load_config
from mimo_sft.config.schema import DataConfig
from mimo_sft.errors import UserError

GOOD = ["--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2", "--micro-batch-size", "4",
        "--global-batch-size", "8"]


def problems(args):
    return [str(p) for p in check_config(load_config(GOOD + args)).problems]


@pytest.mark.parametrize("args,needle", [
    (["--eval-interval", "5"], "[28] --eval-interval without a validation set: add --valid-dataset-path"),
    (["--save-best", "--eval-at-start"], "--eval-at-start, --save-best without a validation set"),
    (["--valid-split", "0"], "--valid-split 0: hold out at least 1 sample"),
    (["--valid-split", "1.5"], "--valid-split 1.5: a fraction must lie strictly between 0 and 1"),
    (["--valid-split", "ten"], "--valid-split 'ten': give a sample count"),
    (["--valid-split", "4", "--valid-dataset-path", "x.parquet"], "--valid-dataset-path and --valid-split are exclusive"),
    (["--valid-dataset-path", "/nowhere/v.parquet"], "--valid-dataset-path /nowhere/v.parquet: not found"),
    (["--valid-split", "4", "--eval-interval", "0"], "--eval-interval=0 must be >= 1"),
    (["--valid-split", "4", "--eval-iters", "-1"], "--eval-iters=-1 must be >= 1 global batch, or 'all'"),
    (["--valid-split", "4", "--eval-iters", "most"], "--eval-iters 'most': give a number of global batches (e.g. 50) or 'all'"),
])
def test_check_28_refuses_bad_validation_flags(args, needle):
    probs = problems(args)
    assert any(needle in p for p in probs), probs
    assert all("\n" not in p for p in probs)


def test_check_28_accepts_good_validation_flags():
    assert problems(["--valid-split", "0.1", "--eval-interval", "2", "--eval-iters", "3", "--eval-at-start",
                     "--save-best"]) == []
    assert problems(["--valid-split", "16"]) == []
    assert problems(["--valid-split", "16", "--eval-iters", "all"]) == []


def test_eval_iters_is_bounded_by_default_and_all_or_the_old_0_is_the_whole_set():
    """The default reads 50 global batches; 'all' the whole set; an explicit 0 (the old default) is
    still the whole set, with a note saying to write 'all'; YAML's integer reads as the flag's text."""
    from mimo_sft.config.loader import config_from_dict
    from mimo_sft.data.validation import evaluated_samples

    cfg = load_config(GOOD + ["--valid-split", "16"])
    assert cfg.train.eval_iters == "50"
    assert evaluated_samples(100_000, eval_iters=cfg.train.eval_iters, global_batch_size=8) == 400
    assert evaluated_samples(100_000, eval_iters="all", global_batch_size=8) == 100_000
    assert evaluated_samples(100_000, eval_iters="ALL", global_batch_size=8) == 100_000
    assert evaluated_samples(100_000, eval_iters="0", global_batch_size=8) == 100_000
    assert config_from_dict({"train": {"eval_iters": 3}}).train.eval_iters == "3"
    result = check_config(load_config(GOOD + ["--valid-split", "16", "--eval-iters", "0"]))
    assert result.problems == []
    notes = [str(n) for n in result.notes if n.check == 28]
    assert len(notes) == 1 and "--eval-iters 0 evaluates the whole validation set" in notes[0], notes
    assert "write --eval-iters all" in notes[0] and "\n" not in notes[0]
    assert not [n for n in check_config(cfg).notes if n.check == 28]
    with pytest.raises(UserError, match="--eval-iters 'x': give a number of global batches"):
        evaluated_samples(10, eval_iters="x", global_batch_size=8)


def _data_cfg(**kw) -> DataConfig:
    return DataConfig(dataset_path=str(demo_dataset_dir()), seq_length=192, **kw)


def test_held_out_split_is_seeded_disjoint_and_never_in_the_training_source():
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import holdout_rows, split_sources

    train_rows, valid_rows = holdout_rows(48, 0.25, seed=3, min_train=8)
    assert len(valid_rows) == 12 and sorted(train_rows + valid_rows) == list(range(48))
    assert holdout_rows(48, 0.25, seed=3, min_train=8) == (train_rows, valid_rows)
    assert holdout_rows(48, 0.25, seed=4, min_train=8)[1] != valid_rows
    assert valid_rows != list(range(36, 48))  # a seeded choice, not the tail of a sorted file
    with pytest.raises(UserError, match="--valid-split 44: holding out 44 of the 48 samples leaves 4"):
        holdout_rows(48, 44, seed=3, min_train=8)
    full = load_sft_dataset(_data_cfg())
    train, valid = split_sources(_data_cfg(valid_split="0.25"), seed=3, global_batch_size=8)
    assert (len(train), len(valid)) == (36, 12)
    for source, rows in ((train, train_rows), (valid, valid_rows)):
        for i, row in enumerate(rows):  # row i of each part is that row of the dataset, nothing else
            assert source[i] == full[row]


def test_the_training_stream_reads_only_the_training_rows():
    """With --valid-split the trainer's iterator gets the training part: its samples are those rows."""
    from mimo_sft.data.loader import build_microbatch_iterator, build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import evaluated_samples, holdout_rows, split_sources

    cfg = _data_cfg(valid_split="12")
    train, _valid = split_sources(cfg, seed=3, global_batch_size=8)
    train_rows, _ = holdout_rows(48, 12, seed=3, min_train=8)
    full, pre = load_sft_dataset(_data_cfg()), build_preprocessor(cfg, tiny_checkpoint_dir())
    it = build_microbatch_iterator(cfg, model_dir=tiny_checkpoint_dir(), micro_batch_size=4, canonical_grid=1,
                                   dp_size=1, dp_rank=0, need_pixels=False, seed=3, consumed_samples=4,
                                   global_batch_size=8, num_workers=0, source=train)
    batch = next(it)  # positions 4..7 of the training part (a resumed run at consumed_samples 4)
    for b, pos in enumerate(batch["sample_ids"].tolist()):
        assert pos == 4 + b
        want = pre.encode(*full[train_rows[pos]], train_rows[pos], need_pixels=False)["input_ids"]
        assert torch.equal(batch["input_ids"][b, : len(want)], want)
    assert evaluated_samples(12, eval_iters="all", global_batch_size=8) == 12
    assert evaluated_samples(12, eval_iters=0, global_batch_size=8) == 12
    assert evaluated_samples(12, eval_iters="1", global_batch_size=8) == 8
    assert evaluated_samples(12, eval_iters=2, global_batch_size=8) == 12


def test_a_resume_must_hold_out_what_the_saved_run_held_out():
    from mimo_sft.data.validation import check_resumed_split

    check_resumed_split("0.10", _data_cfg(valid_split="0.1"), checkpoint="ck")  # the same split, spelled otherwise
    check_resumed_split(None, _data_cfg(), checkpoint="ck")
    with pytest.raises(UserError, match=r"--load-checkpoint ck was trained with --valid-split 8; resume with the same"):
        check_resumed_split("8", _data_cfg(), checkpoint="ck")
    with pytest.raises(UserError, match="was trained with no --valid-split"):
        check_resumed_split(None, _data_cfg(valid_split="8"), checkpoint="ck")


def _reader(n, *, dp_size, dp_rank, scalable, mbs=4):
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import ValidationReader

    cfg = _data_cfg()
    return ValidationReader(load_sft_dataset(cfg), build_preprocessor(cfg, tiny_checkpoint_dir()), n_samples=n,
                            micro_batch_size=mbs, dp_size=dp_size, dp_rank=dp_rank, need_pixels=True,
                            scalable_dp=scalable, num_workers=0, pad_to_seq_length=True)


def test_reader_reads_each_sample_once_in_order_and_fills_the_last_micro_batch_uncounted():
    """10 samples in micro-batches of 4 on 2 DP ranks: 3 micro-batches, positions 10 and 11 are
    copies of samples 0 and 1 with no loss; both ways of reading a shard give the same batches, and
    the tokens counted equal the pre-check's count."""
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import check_validation_set

    cfg = _data_cfg()
    expected = check_validation_set(load_sft_dataset(cfg), build_preprocessor(cfg, tiny_checkpoint_dir()), 10,
                                    flag="--valid-dataset-path")
    whole = list(_reader(10, dp_size=1, dp_rank=0, scalable=True))
    assert len(whole) == 3
    ids = torch.cat([b["sample_ids"] for b in whole]).tolist()
    assert ids == list(range(10)) + [0, 1]
    mask = torch.cat([b["loss_mask"] for b in whole])
    assert mask[10:].sum() == 0 and mask[:2].sum() > 0 and float(mask.sum()) == expected
    for scalable in (True, False):
        shards = [list(_reader(10, dp_size=2, dp_rank=r, scalable=scalable)) for r in (0, 1)]
        for k, full in enumerate(whole):
            for key in ("input_ids", "labels", "loss_mask", "pixel_values"):
                joined = torch.cat([shards[0][k][key], shards[1][k][key]])
                assert torch.equal(joined, full[key]), (scalable, k, key)


def _write_rows(tmp_path, rows, name="valid.parquet"):
    import datasets

    path = str(tmp_path / name)
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def test_a_validation_set_without_assistant_tokens_is_refused(tmp_path):
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import check_validation_set

    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"question {i}"}]}]} for i in range(3)]
    cfg = DataConfig(dataset_path=_write_rows(tmp_path, rows), seq_length=64)
    with pytest.raises(UserError, match=r"--valid-dataset-path: the 3 validation samples have no supervised tokens"):
        check_validation_set(load_sft_dataset(cfg), build_preprocessor(cfg, tiny_checkpoint_dir()), 3,
                             flag="--valid-dataset-path")


def test_a_validation_sample_whose_images_do_not_fit_is_refused_not_replaced():
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import check_validation_set

    cfg = dataclasses.replace(_data_cfg(), seq_length=12)
    with pytest.raises(UserError, match=r"--valid-split: validation sample \d+ \(.*demo.*, row \d+\) needs \d+ tokens "
                                        r"for its images and clips, more than --seq-length 12"):
        check_validation_set(load_sft_dataset(cfg), build_preprocessor(cfg, tiny_checkpoint_dir()), 8,
                             flag="--valid-split")


# ---- --save-best: the best checkpoint survives pruning ------------------------------------------------

def _published(root, step):
    from mimo_sft.train.checkpoint.files import publish

    tmp = os.path.join(root, f"iter_{step:07d}.tmp")
    os.makedirs(os.path.join(tmp, "model"))
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump({"step": step}, fh)
    return publish(root, tmp, step, keep_last=1)


def test_best_is_never_pruned_and_the_old_best_goes_once_replaced(tmp_path):
    from mimo_sft.train.checkpoint.files import BEST, complete_checkpoints, latest_name, mark_best

    root = str(tmp_path)
    names = lambda: [n for _s, _v, n in complete_checkpoints(root)]  # noqa: E731
    mark_best(root, _published(root, 1), keep_last=1)
    _published(root, 2)
    _published(root, 3)  # keep-last 1 removes step 2, never the best (step 1)
    assert names() == ["iter_0000001", "iter_0000003"] and latest_name(root, BEST) == "iter_0000001"
    mark_best(root, os.path.join(root, "iter_0000003"), keep_last=1)
    assert names() == ["iter_0000003"] and latest_name(root, BEST) == "iter_0000003"
    # a resumed run re-saving the best step keeps the folder best names (it holds the same weights)
    mark_best(root, _published(root, 4), keep_last=1)
    again = _published(root, 4)
    assert os.path.basename(again) == "iter_0000004.v2" and os.path.isdir(os.path.join(root, "iter_0000004"))
