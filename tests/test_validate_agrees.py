"""``validate`` refuses what ``finetune`` refuses (issue 42 item 3, issue 55 item 2): for each bad source a user
can give, both commands run on the same flags and their verdicts are compared -- one line naming the source,
exit 2, no traceback. Streamed sources are opened by ``validate`` as start-up opens them (shard lists, footers,
tar headers, no pixels); a loaded parquet by its footers (schema and row count); a hub name is refused offline
(the tests run with HF_HUB_OFFLINE=1, tests/conftest.py); and every image and clip file is stat'ed as start-up's
file check does (``data.source_probe``)."""

from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from train_helpers import demo_data, python_m, tiny_model

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_sources")
    table = pq.read_table(next(p for p in __import__("pathlib").Path(demo_data()).rglob("*.parquet")))
    (root / "zero").mkdir()
    pq.write_table(table.slice(0, 0), root / "zero" / "train-00000.parquet")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "train-00000.parquet").write_bytes(b"PAR1" + b"not a footer" * 8)
    (root / "empty").mkdir()
    (root / "rows.jsonl").write_text(json.dumps(ROW) + "\n")
    with tarfile.open(root / "shard-00000.tar.gz", "w:gz") as tf:
        blob = json.dumps(ROW).encode()
        info = tarfile.TarInfo("0.json")
        info.size = len(blob)
        tf.addfile(info, io.BytesIO(blob))
    (root / "cols").mkdir()
    pq.write_table(pa.table({"messages": [json.dumps(ROW["messages"])]}), root / "cols" / "train-00000.parquet")
    pq.write_table(pa.table({"conversations": ["x"]}), root / "cols" / "train-00001.parquet")
    (root / "loaded_zero").mkdir()  # a loaded (not streamed) folder whose one parquet file has no rows
    pq.write_table(table.slice(0, 0), root / "loaded_zero" / "train-00000.parquet")
    pq.write_table(table.rename_columns([{"messages": "dialogue"}.get(c, c) for c in table.column_names]),
                   root / "misnamed.parquet")  # the messages under another name, no --messages-column
    _clip_rows(root)
    return root


def _clip_rows(root) -> None:
    """``clips.parquet``: 4 rows naming a clip each, row 2's clip missing (every other file there)."""
    from mimo_sft.testing.clips import write_clip

    (root / "clips").mkdir()
    write_clip(root / "clips" / "c.mp4", frames=4, width=32, height=32, fps=4)
    rows = [{"messages": [{"role": "user", "content": [{"type": "video", "video": "clips/gone.mp4" if i == 2 else
                                                        "clips/c.mp4", "text": None},
                                                       {"type": "text", "video": None, "text": "?"}]},
                          {"role": "assistant", "content": [{"type": "text", "video": None, "text": "a"}]}]}
            for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), root / "clips.parquet")


#: case -> (the source flags, relative to the fixture's folder; what the one line must say)
CASES = {
    "streaming_jsonl": (["rows.jsonl", "--streaming"], "'streaming: true' only on the sources that are shards"),
    "compressed_tar": (["shard-00000.tar.gz"], "is a compressed tar"),
    "corrupt_shard": (["corrupt", "--streaming"], "is not a readable parquet file"),
    "zero_row_shards": (["zero", "--streaming"], "has no rows"),
    "no_shards": (["empty", "--streaming"], "no .parquet or .tar shards found"),
    "columns_differ": (["cols", "--streaming"], "every shard of a source needs the same columns"),
    # loaded sources (issue 55 item 2): the footers' row count and columns, the hub offline, a clip file's stat
    "zero_row_parquet": (["loaded_zero"], "loaded_zero: cannot load (it has no rows; give a source that holds samples)"),
    "misnamed_messages_column": (["misnamed.parquet"], "no 'messages' or 'conversations' column (columns: dialogue"),
    "hub_name_offline": (["hub:someone/some-dataset"], "is not a local file or folder and the hub is offline"),
    "missing_clip": (["clips.parquet"], "sample 2: video file "),
    "zero_row_validation_set": (["clips.parquet", "--valid-dataset-path", "loaded_zero"],
                                "validation set (--valid-dataset-path, --valid-dataset-split): --dataset-path "),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_and_finetune_give_the_same_verdict(bad, case, tmp_path):
    source, says = CASES[case]
    path = source[0][len("hub:"):] if source[0].startswith("hub:") else str(bad / source[0])
    rest = [str(bad / a) if a == "loaded_zero" else a for a in source[1:]]
    flags = ["--hf-model", tiny_model(), "--component", "language=dp=1", "--component", "images=dp=1",
             "--dataset-path", path, *rest, "--seq-length", "128", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "1", "--no-save", "--no-tensorboard"]
    checked = python_m(["validate", "--json", *flags, "--output-dir", str(tmp_path / "v")])
    verdict = json.loads(checked.stdout)
    assert checked.returncode == 2 and not verdict["ok"], checked.stdout
    assert any(says in p for p in verdict["problems"]), verdict["problems"]
    run = python_m(["finetune", *flags, "--output-dir", str(tmp_path / "f")])
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(errors) == 1 and says in errors[0], run.stderr[-2000:]


def test_a_zero_row_loaded_source_says_so_in_words(bad, tmp_path):
    run = python_m(["finetune", "--hf-model", tiny_model(), "--component", "language=dp=1", "--component",
                    "images=dp=1", "--dataset-path", str(bad / "zero"), "--train-iters", "1", "--no-save",
                    "--output-dir", str(tmp_path / "f")])
    assert run.returncode == 2 and "it has no rows" in run.stderr and "BatchSize" not in run.stderr, run.stderr[-2000:]


def test_validate_counts_a_loaded_parquets_rows_from_its_footer(bad, tmp_path):
    """The footers' row count says what start-up says about it, in one process: a set under one global batch, a
    --valid-split that leaves less than one, and each loaded source's rows and epochs in a mixture's notes."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    base = ["--hf-model", tiny_model(), "--component", "language=dp=1", "--component", "images=dp=1",
            "--seq-length", "128", "--train-iters", "3", "--output-dir", str(tmp_path / "v")]
    rows = pq.read_table(bad / "clips.parquet")  # its rows 0, 1 and 3 name a clip that is there
    pq.write_table(rows.take([0, 1, 3]), bad / "three.parquet")
    pq.write_table(rows.take([0, 1]), bad / "two.parquet")
    ok, two = str(bad / "three.parquet"), str(bad / "two.parquet")

    def problems(*flags):
        return [str(p) for p in check_config(load_config([*base, *flags])).problems]

    assert problems("--dataset-path", ok, "--micro-batch-size", "1", "--global-batch-size", "4") == [
        "[17] the dataset has 3 samples, fewer than one global batch (--global-batch-size 4); add samples or lower "
        "the batch size"]
    assert problems("--dataset-path", ok, "--micro-batch-size", "1", "--global-batch-size", "2",
                    "--valid-split", "2") == [
        "[17] --valid-split 2: holding out 2 of the 3 samples leaves 1, fewer than one global batch (2); hold out "
        "fewer samples"]
    assert problems("--dataset-path", ok, "--micro-batch-size", "1", "--global-batch-size", "2",
                    "--valid-split", "1") == []
    result = check_config(load_config([*base, "--dataset-path", ok, "--dataset-path", two,
                                       "--micro-batch-size", "2", "--global-batch-size", "2"]))
    assert result.problems == []
    lines = [n.message for n in result.notes if n.message.startswith("source '")]
    assert len(lines) == 2 and "3 rows, read" in lines[0] and "2 rows, read" in lines[1], lines
