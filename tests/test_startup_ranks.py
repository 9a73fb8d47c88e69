"""Start-up work split over real gloo ranks (issue 33): the dataset converted once per node (the
other ranks open the same Arrow cache after the first rank), a load failure reaching every rank as
the same line, and the validation set tokenised once over the ranks with the same refusals as one
process."""

from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest

from data_fixtures import demo_dataset_dir, tiny_checkpoint_dir
from dist_utils import run_distributed
from mimo_sft.config.schema import DataConfig

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]


def _pstate(rank):
    import torch.distributed as dist

    return SimpleNamespace(rank=rank, startup_gloo=dist.new_group(backend="gloo"))


def _open_worker(rank, world, data_path):
    """Each rank's (load start, load end, cache files) through ``checked_source``; then a missing path."""
    from mimo_sft.data import sources
    from mimo_sft.errors import UserError
    from mimo_sft.train.feed import checked_source

    times = []
    real = sources.load_sft_dataset

    def timed(*a, **kw):
        t0 = time.time()
        time.sleep(0.5 if rank == 0 else 0.0)  # a slow first rank: the others must still wait for it
        out = real(*a, **kw)
        times.append((t0, time.time()))
        return out

    sources.load_sft_dataset = timed
    pstate = _pstate(rank)
    cfg = SimpleNamespace(data=DataConfig(dataset_path=data_path), logging=SimpleNamespace(output_dir=None))
    try:
        source = checked_source(cfg, pstate)
        bad = dataclasses.replace(cfg.data, dataset_path=data_path + ".nowhere.parquet")
        try:
            checked_source(cfg, pstate, bad)
            error = None
        except UserError as err:
            error = str(err)
    finally:
        sources.load_sft_dataset = real
    return times, [f["filename"] for f in source.ds.cache_files], len(source), error


def test_the_first_rank_of_a_node_converts_and_the_others_open_its_cache(tmp_path):
    import datasets

    path = str(tmp_path / "rows.parquet")
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                                              {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
                                for i in range(50)]).to_parquet(path)
    (t0, files0, n0, err0), (t1, files1, n1, err1) = run_distributed(_open_worker, 2, path)
    assert len(t0) == len(t1) == 1  # the missing path: refused on rank 0 only, rank 1 never tried
    assert t1[0][0] >= t0[0][1], (t0, t1)  # rank 1 opened after rank 0 had converted
    assert files0 == files1 and len(files0) == 1 and files0[0].endswith(".arrow")  # one Arrow file, both map it
    assert n0 == n1 == 50
    assert err0 == err1 and err0.startswith(f"--dataset-path {path}.nowhere.parquet does not exist")


def _tokens_worker(rank, world, model, data_path, seq_length, n):
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.errors import UserError
    from mimo_sft.train.evaluate import checked_tokens

    cfg = DataConfig(dataset_path=data_path, seq_length=seq_length)
    pre = build_preprocessor(cfg, model)
    calls = []
    real = pre.tokens
    pre.tokens = lambda messages, grids, i: calls.append(i) or real(messages, grids, i)
    try:
        return checked_tokens(load_sft_dataset(cfg), pre, n, flag="--valid-split", group=_pstate(rank).startup_gloo), calls
    except UserError as err:
        return str(err), calls


def _rows(tmp_path, image_at: int, n: int = 6) -> str:
    """Text-only rows, the one at ``image_at`` with a 224x224 image (more tokens than a short --seq-length)."""
    from PIL import Image

    Image.new("RGB", (224, 224), (200, 0, 0)).save(tmp_path / "big.png")
    rows = []
    for i in range(n):
        content = [{"type": "text", "text": f"question {i}"}]
        if i == image_at:
            content = [{"type": "image", "image": str(tmp_path / "big.png")}] + content
        rows.append({"messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]})
    path = tmp_path / "valid.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_the_validation_set_is_tokenised_once_over_the_ranks(tmp_path):
    """Each of 2 ranks tokenises every other sample; the token total equals one process's count, and
    a refused sample that only rank 1 tokenises (sample 3) stops both ranks with one process's line."""
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.data.validation import check_validation_set
    from mimo_sft.errors import UserError

    cfg = DataConfig(dataset_path=str(demo_dataset_dir()), seq_length=192)
    expected = check_validation_set(load_sft_dataset(cfg), build_preprocessor(cfg, tiny_checkpoint_dir()), 10,
                                    flag="--valid-split")
    (tok0, calls0), (tok1, calls1) = run_distributed(_tokens_worker, 2, str(tiny_checkpoint_dir()),
                                                        str(demo_dataset_dir()), 192, 10)
    assert tok0 == tok1 == expected and calls0 == [0, 2, 4, 6, 8] and calls1 == [1, 3, 5, 7, 9]

    path = _rows(tmp_path, image_at=3)
    short = DataConfig(dataset_path=path, seq_length=24)
    with pytest.raises(UserError) as one:
        check_validation_set(load_sft_dataset(short), build_preprocessor(short, tiny_checkpoint_dir()), 6,
                             flag="--valid-split")
    assert str(one.value).startswith(f"--valid-split: validation sample 3 ({path}, row 3) needs ")
    (err0, calls0), (err1, calls1) = run_distributed(_tokens_worker, 2, str(tiny_checkpoint_dir()), path, 24, 6)
    assert err0 == err1 == str(one.value) and 3 in calls1 and 3 not in calls0
