"""Cost files (``check-data --write-costs``): the counts index mode plans from without reading a row.

Checked against the text path itself (the independent reference: ``SamplePreprocessor.encode`` of
every row), on the demo's rows (text-only, multi-image, large pages; a ``--seq-length`` at which some
large pages drop) as a mixture of a ``datasets``-loaded source and a streamed one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.config.schema import DataConfig
from mimo_sft.data.cost_file import DROPPED, load_cost_tables
from mimo_sft.data.sources import load_sft_dataset
from mimo_sft.testing.demo_data import demo_rows, write_demo_dataset, write_shards

SEQ = 72  # a large page's image tokens pass it: those rows are dropped and replaced
#: the tiny processor's own limit, given explicitly: unset, it would be lowered to fit SEQ and nothing would drop
MAX_PIXELS = 50176


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_ckpt):  # noqa: F811
    from mimo_sft.data.check import check_dataset

    root = tmp_path_factory.mktemp("costs")
    write_demo_dataset(root / "docs.parquet", samples=40, seed=11)
    write_shards(demo_rows(30, seed=12), root / "web", shards=2, kind="webdataset")
    cfg = dataclasses.replace(DataConfig(), seq_length=SEQ, max_pixels=MAX_PIXELS, cost_dir=str(root / "costs"), datasets=[
        {"path": str(root / "docs.parquet"), "name": "docs"}, {"path": str(root / "web"), "name": "web"}])
    report = check_dataset(cfg, model_dir=str(tiny_ckpt), workers=0, chunk=16, write_costs=True)
    return cfg, report, root


def _pre(cfg, ckpt):
    from mimo_sft.data.loader import build_preprocessor

    return build_preprocessor(cfg, str(ckpt))


def test_the_file_holds_the_text_paths_counts(setup, tiny_ckpt):  # noqa: F811
    from mimo_sft.data.preprocess import TruncatedImageError

    cfg, report, _root = setup
    assert len(report["cost_files"]) == 2
    source, pre = load_sft_dataset(cfg), _pre(cfg, tiny_ckpt)
    tables = load_cost_tables(source, pre, __import__("pathlib").Path(cfg.cost_dir))
    assert all(t is not None for t in tables)
    dropped = 0
    for s, (part, table) in enumerate(zip(source.parts, tables)):
        for row in range(len(part)):
            messages, refs = part[row]
            try:
                ids = pre.encode(messages, refs, row, need_pixels=False)["input_ids"]
            except TruncatedImageError:
                assert table.tokens[row] == DROPPED
                dropped += 1
                continue
            assert (table.tokens[row], table.image_tokens[row]) == (len(ids), int((ids == pre.image_token_id).sum()))
    assert dropped > 0 and dropped == report["counts"]["image_tokens_past_seq_length"]


class _Unreadable:
    """A source whose rows cannot be read (the injected fault): planning from a cost file must not try."""

    def __init__(self, inner):
        self.inner = inner
        self.parts, self.names, self.locate, self.next_index = inner.parts, inner.names, inner.locate, inner.next_index

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, idx):
        raise AssertionError(f"row {idx} was read")


@pytest.mark.parametrize("language_weight", [0.0, 0.5])
def test_costs_from_the_file_equal_the_computed_ones_and_read_no_row(setup, tiny_ckpt, language_weight):  # noqa: F811
    from mimo_sft.data.cost_file import SourceCounts
    from mimo_sft.data.indexed import ShardCostDataset
    from mimo_sft.data.loader import model_token_info
    from mimo_sft.data.reorder.cost_model import make_cost_fn, make_count_cost_fn, make_patch_count_fn

    cfg, _report, _root = setup
    source, pre = load_sft_dataset(cfg), _pre(cfg, tiny_ckpt)
    info = model_token_info(str(tiny_ckpt))
    ids = dict(image_token_id=info["image_token_id"], merge_size=info["spatial_merge_size"])
    cost_fn = make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=language_weight, **ids)
    count_costs = make_count_cost_fn(encoder_cost_weight=1.0, language_cost_weight=language_weight,
                                     merge_size=ids["merge_size"])
    computed = ShardCostDataset(source, pre, cost_fn=cost_fn, load_fn=make_patch_count_fn(**ids))
    counts = SourceCounts(source, load_cost_tables(source, pre, __import__("pathlib").Path(cfg.cost_dir)))
    looked_up = ShardCostDataset(_Unreadable(source), pre, cost_fn=cost_fn, load_fn=make_patch_count_fn(**ids),
                                 counts=counts, count_costs=count_costs)
    order = source.order(seed=1, shuffle=False)
    for k in range(12):  # 12 micro-batches of 8: both sources wrap, dropped rows are replaced
        indices = order.indices(8 * k, 8 * (k + 1))
        a, b = computed[indices], looked_up[indices]
        assert a == b, (k, a, b)


def test_a_changed_input_finds_no_file(setup, tiny_ckpt):  # noqa: F811
    cfg, _report, root = setup
    from pathlib import Path

    other = dataclasses.replace(cfg, seq_length=SEQ + 64)
    source = load_sft_dataset(other)
    assert load_cost_tables(source, _pre(other, tiny_ckpt), Path(cfg.cost_dir)) == [None, None]
    # each source is told why its file is not used (issue 42 item 6): made for another --seq-length
    from mimo_sft.data.cost_file import other_settings

    why = [other_settings(part, _pre(other, tiny_ckpt), Path(cfg.cost_dir)) for part in source.parts]
    assert all(w and f"--seq-length {SEQ} (this run: {SEQ + 64})" in w and "computed from the rows" in w for w in why)
    assert other_settings(source.parts[0], _pre(cfg, tiny_ckpt), Path(cfg.cost_dir)) is None  # its own settings
    write_shards(demo_rows(31, seed=12), root / "web", shards=2, kind="webdataset")  # the streamed source's rows change
    source = load_sft_dataset(cfg)
    tables = load_cost_tables(source, _pre(cfg, tiny_ckpt), Path(cfg.cost_dir))
    assert tables[0] is not None and tables[1] is None
    assert np.all(tables[0].tokens[:3] > 0)
