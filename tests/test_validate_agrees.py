"""``validate`` refuses what ``finetune`` refuses (issue 42 item 3): for each bad source a user can give, both
commands run on the same flags and their verdicts are compared -- one line naming the source, exit 2, no
traceback. Streamed sources are opened by ``validate`` as start-up opens them (shard lists, footers, tar
headers, no pixels); a loaded source's rows are read by neither ``validate`` nor this table."""

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
    return root


#: case -> (the source flags, relative to the fixture's folder; what the one line must say)
CASES = {
    "streaming_jsonl": (["rows.jsonl", "--streaming"], "'streaming: true' only on the sources that are shards"),
    "compressed_tar": (["shard-00000.tar.gz"], "is a compressed tar"),
    "corrupt_shard": (["corrupt", "--streaming"], "is not a readable parquet file"),
    "zero_row_shards": (["zero", "--streaming"], "has no rows"),
    "no_shards": (["empty", "--streaming"], "no .parquet or .tar shards found"),
    "columns_differ": (["cols", "--streaming"], "every shard of a source needs the same columns"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_and_finetune_give_the_same_verdict(bad, case, tmp_path):
    source, says = CASES[case]
    flags = ["--hf-model", tiny_model(), "--component", "language=dp=1", "--component", "images=dp=1",
             "--dataset-path", str(bad / source[0]), *source[1:], "--seq-length", "128", "--micro-batch-size", "1",
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
