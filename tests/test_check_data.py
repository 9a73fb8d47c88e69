"""Messy input (issue 26): every bad row, file or path is one line naming it, found before step 0.

A dataset of hand-made rows in the shapes people feed such tools (good and broken PNGs, a folder
where an image should be, a 1x4000 strip, a header claiming 14000x14000 pixels, a placeholder
count mismatch, a missing file, an answer longer than --seq-length, an empty answer, a text-only row,
images over and under the pixel bounds) goes through ``check-data`` (every problem listed with its
sample, counts right), ``plan`` and the preprocessing path (one line, no traceback).
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.cli import app
from mimo_sft.errors import BadSampleError, UserError

runner = CliRunner()


def png(w: int, h: int, colour=(200, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h pixels and whose pixel data is empty (a bomb, cheaply)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def row(images: list[str], answer: str = "It is red.", parts: int | None = None) -> dict:
    n = len(images) if parts is None else parts
    return {"messages": [{"role": "user", "content": [{"type": "image", "text": None}] * n + [{"type": "text", "text": "What colour?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": images}


#: row index -> what is wrong with it (None: nothing)
MESSY = {0: None, 1: "truncated png", 2: "folder", 3: "1x4000", 4: "bomb", 5: "placeholders", 6: "missing",
         7: "long answer", 8: "empty answer", 9: "text only", 10: "over max pixels", 11: "under min pixels"}


def write_messy(folder: Path) -> Path:
    img = folder / "img"
    img.mkdir(parents=True)
    (img / "good.png").write_bytes(png(64, 64))
    data = png(64, 64)
    (img / "cut.png").write_bytes(data[: len(data) // 2])
    (img / "a_folder.png").mkdir()
    (img / "strip.png").write_bytes(png(1, 4000))
    (img / "bomb.png").write_bytes(png_header(14000, 14000))
    (img / "big.png").write_bytes(png(300, 300))
    (img / "small.png").write_bytes(png(28, 28))
    rows = [row(["img/good.png"]), row(["img/cut.png"]), row(["img/a_folder.png"]), row(["img/strip.png"]),
            row(["img/bomb.png"]), row(["img/good.png"], parts=2), row(["img/missing.png"]),
            row(["img/good.png"], answer=" ".join(f"w{i}" for i in range(400))), row(["img/good.png"], answer=""),
            row([]), row(["img/big.png"]), row(["img/small.png"])]
    path = folder / "messy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> Path:
    return write_messy(tmp_path_factory.mktemp("messy"))


def _check_data(tiny_ckpt, data, *extra):
    return runner.invoke(app, ["check-data", "--hf-model", str(tiny_ckpt), "--dataset-path", str(data),
                               "--seq-length", "256", *extra])


def test_check_data_lists_every_problem_with_its_sample_and_file(tiny_ckpt, messy):
    res = _check_data(tiny_ckpt, messy, "--json", "--workers", "2")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    by_index = {p["index"]: p for p in report["problems"]}
    assert sorted(by_index) == [1, 2, 3, 4, 5, 6], report["problems"]
    assert by_index[1]["path"].endswith("cut.png") and "cannot decode" in by_index[1]["reason"]
    assert by_index[2]["path"].endswith("a_folder.png") and "is a folder" in by_index[2]["reason"]
    assert by_index[3]["path"].endswith("strip.png") and "1x4000" in by_index[3]["reason"]
    assert by_index[4]["path"].endswith("bomb.png") and "--max-image-pixels" in by_index[4]["reason"]
    assert "placeholder" in by_index[5]["reason"]
    assert by_index[6]["path"].endswith("missing.png") and "not found" in by_index[6]["reason"]
    c, first = report["counts"], report["first_sample"]
    assert c["samples"] == 12 and c["bad_samples"] == 6 and c["text_only"] == 1
    assert c["truncated_answers"] == 1 and first["truncated_answers"] == 7
    assert c["empty_answers"] == 1 and first["empty_answers"] == 8
    assert c["images_over_max_pixels"] == 1 and first["images_over_max_pixels"] == 10
    assert c["images_under_min_pixels"] == 1 and first["images_under_min_pixels"] == 11


def test_check_data_in_process_equals_workers_and_prints_a_table(tiny_ckpt, messy):
    a = json.loads(_check_data(tiny_ckpt, messy, "--json", "--workers", "0").stdout)
    b = json.loads(_check_data(tiny_ckpt, messy, "--json", "--workers", "2").stdout)
    assert a["counts"] == b["counts"] and a["problems"] == b["problems"]
    res = _check_data(tiny_ckpt, messy, "--workers", "0")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "problem: sample 2 (" in res.stdout and "a_folder.png): is a folder" in res.stdout
    assert "answers cut at --seq-length" in res.stdout and "first: sample 7" in res.stdout
    assert "6 problem(s)" in res.stdout


def test_check_data_reports_progress_as_it_goes(tiny_ckpt, messy, capsys, monkeypatch):
    """Issue 42 item 6: check-data says how far it is -- a bar with the time left on a terminal, a rate line
    every few seconds off one (100k tar rows printed nothing for 51 s) -- on stderr, so --json stays clean."""
    from mimo_sft.check_data import Progress
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.check import check_dataset

    seen = []
    check_dataset(DataConfig(dataset_path=str(messy), seq_length=512), model_dir=str(tiny_ckpt), workers=0, chunk=4,
                  progress=lambda done, total: seen.append((done, total)))
    assert seen == [(4, 12), (8, 12), (12, 12)]
    monkeypatch.setattr(Progress, "LINE_EVERY_S", 0.0)
    with Progress() as progress:  # pytest's stderr is not a terminal: lines
        for done in (4, 8, 12):
            progress.update(done, 12)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("check-data: 4 of 12 samples (") and "s left)" in err[0], err


def test_check_data_on_clean_rows_is_ok(tiny_ckpt, messy, tmp_path):
    lines = messy.read_text().splitlines()
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(lines[i] for i in (0, 9, 10)).replace('"img/', f'"{messy.parent}/img/') + "\n")
    res = _check_data(tiny_ckpt, clean, "--json", "--workers", "0")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ok"]


def _pre(tiny_ckpt, **kw):
    from mimo_sft.data.preprocess import SamplePreprocessor

    return SamplePreprocessor(tiny_ckpt, seq_length=256, **kw)


def test_oversized_image_names_sample_and_path_and_can_be_allowed(tiny_ckpt, messy):
    bomb = messy.parent / "img" / "bomb.png"
    with pytest.raises(BadSampleError) as err:
        _pre(tiny_ckpt).image_specs([bomb], 4)
    assert err.value.index == 4 and err.value.path == str(bomb) and "14000x14000" in str(err.value)
    allowed = _pre(tiny_ckpt, max_image_pixels=0).image_specs([bomb], 4)  # header only: resized like any image
    (t, h, w), = [s.grid for s in allowed]
    assert t == 1 and h == w and h * w * 14 * 14 <= 50176
    with pytest.raises(BadSampleError, match=r"sample 3 \(.*strip.png\): image of 1x4000 pixels"):
        _pre(tiny_ckpt).image_specs([messy.parent / "img" / "strip.png"], 3)


def test_plan_on_an_oversized_image_is_one_line(tiny_ckpt, messy, tmp_path):
    lines = messy.read_text().splitlines()
    data = tmp_path / "bomb.jsonl"
    data.write_text("\n".join([lines[4].replace('"img/', f'"{messy.parent}/img/')] * 8) + "\n")
    res = runner.invoke(app, ["plan", "--hf-model", str(tiny_ckpt), "--dataset-path", str(data), "--component",
                              "language=dp=1", "--component", "images=dp=1,rank_offset=1", "--micro-batch-size", "4",
                              "--global-batch-size", "4", "--steps", "1"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "sample 0" in err and "bomb.png" in err and "--max-image-pixels" in err


def test_folder_where_an_image_should_be_is_said_to_be_a_folder(messy):
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.sources import load_sft_dataset

    lines = messy.read_text().splitlines()
    data = messy.parent / "folder_only.jsonl"
    data.write_text("\n".join(lines[i] for i in (0, 2, 0, 0)) + "\n")
    with pytest.raises(UserError, match=r"sample 1: image file .*a_folder.png is a folder, not an image file"):
        load_sft_dataset(DataConfig(dataset_path=str(data)))


def test_malformed_jsonl_line_and_object_top_level_json_are_named(tmp_path):
    from mimo_sft.data.sources import load_raw_dataset

    good = [json.dumps(row([])) for _ in range(6)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:3] + [good[3][:-7]] + good[4:]) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl: cannot load \(invalid JSON at line 4, column \d+"):
        load_raw_dataset(str(bad))
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"data": [row([]) for _ in range(4)]}))
    with pytest.raises(UserError) as err:
        load_raw_dataset(str(nested))
    msg = str(err.value)
    assert "top level is an object" in msg and "jq '.data'" in msg and "--conversations-column" not in msg
    one_sample = tmp_path / "one.json"
    one_sample.write_text(json.dumps([row([])]))
    assert len(load_raw_dataset(str(one_sample))) == 1  # a one-sample list is not mistaken for a nested file


def test_validate_refuses_unusable_output_folders(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["validate", "--json", "--component", "language=dp=1", "--component", "images=dp=1",
            "--micro-batch-size", "1", "--global-batch-size", "1"]
    cases = {("--output-dir", str(a_file)): "[26] --output-dir",
             ("--output-dir", str(a_file / "run")): f"cannot be created: {a_file} is a file",
             ("--save", "/sys/mimo-sft-test"): "[26] --save /sys/mimo-sft-test cannot be created: /sys is not writable",
             ("--export-hf", str(a_file)): "[27] --export-hf",
             ("--save-grads", str(a_file / "g")): "[27] --save-grads"}
    for (flag, value), expected in cases.items():
        res = runner.invoke(app, [*base, "--output-dir", str(tmp_path / "run"), flag, value])
        problems = json.loads(res.stdout)["problems"]
        assert res.exit_code == 2 and len(problems) == 1 and expected in problems[0], (flag, problems)
    res = runner.invoke(app, [*base, "--output-dir", str(tmp_path / "new" / "run"), "--export-hf", str(tmp_path / "hf")])
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"]
    assert not (tmp_path / "new").exists()  # checking a folder does not create it


def test_negative_lr_is_one_consistent_line():
    res = runner.invoke(app, ["validate", "--json", "--component", "language=dp=1", "--lr", "-1e-5"])
    problems = json.loads(res.stdout)["problems"]
    assert problems == ["[01] --lr=-1e-05 must be >= 0"]


def test_no_save_with_flags_that_need_a_checkpoint_is_refused():
    res = runner.invoke(app, ["validate", "--json", "--component", "language=dp=1", "--no-save", "--save-interval", "5",
                              "--export-hf", "/tmp/x"])
    problems = json.loads(res.stdout)["problems"]
    assert res.exit_code == 2 and len(problems) == 1, problems
    assert problems[0].startswith("[15] --no-save with --save-interval, --export-hf")


def test_check_data_help_and_bad_flags_are_one_line(tiny_ckpt):
    res = runner.invoke(app, ["check-data", "--help"])
    assert res.exit_code == 0 and "--workers" in res.stdout and "--seq-length" in res.stdout
    res = runner.invoke(app, ["check-data", "--dataset-path", "x.jsonl"])
    assert res.exit_code == 2 and "needs --hf-model" in res.stderr and "Traceback" not in res.output
    res = _check_data(tiny_ckpt, "x.jsonl", "--workers", "two")
    assert res.exit_code == 2 and "--workers 'two'" in res.stderr


def test_max_image_pixels_default_is_pils_own_limit():
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.images import PIL_BOMB_LIMIT

    assert DataConfig().max_image_pixels == PIL_BOMB_LIMIT == 2 * 89_478_485  # PIL raises above 2 x MAX_IMAGE_PIXELS


def test_finetune_refuses_unusable_output_folders_before_step_0(tiny_ckpt, messy, tmp_path):
    import subprocess
    import sys

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "finetune", "--component", "language=dp=1", "--component",
                           "images=dp=1", "--hf-model", str(tiny_ckpt), "--dataset-path", str(messy),
                           "--output-dir", str(a_file / "run"), "--export-hf", "/sys/mimo-sft-hf"],
                          capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: [26] --output-dir") and lines[1].startswith("error: [27] --export-hf")
    assert not (a_file.parent / "run").exists()


def _same_bad_rows(folder: Path, form: str) -> Path:
    """Four rows, their images named in ``form``'s place; row 1 has two image placeholders for one image, row 2 a
    data URI that is not base64."""
    (folder / "img").mkdir(exist_ok=True)
    (folder / "img" / "good.png").write_bytes(png(64, 64))
    rows = []
    for i in range(4):
        ref = "data:image/png,abc" if i == 2 else "img/good.png"
        n = 2 if i == 1 else 1
        if form == "images column":
            rows.append(row([ref], parts=n))
        elif form == "message parts":
            parts = [{"type": "image", "image": ref}] + [{"type": "image"}] * (n - 1) + [{"type": "text", "text": "Colour?"}]
            rows.append({"messages": [{"role": "user", "content": parts},
                                      {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]})
        else:  # ShareGPT/LLaVA: one path in 'image', or a list in 'images'
            turns = [{"from": "human", "value": "<image>\n" * n + "Colour?"}, {"from": "gpt", "value": "Red."}]
            rows.append({"conversations": turns, **({"image": ref} if form == "sharegpt image" else {"images": [ref]})})
    path = folder / f"{form.replace(' ', '_')}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FORMS = ("images column", "message parts", "sharegpt image", "sharegpt images")


def test_a_bad_row_is_the_same_wherever_its_images_are_named(tiny_ckpt, tmp_path):
    """Issue 44 item 5: rows whose images were named in the message parts were read when the dataset opened, so one
    bad row there stopped check-data with exit 2 (and a run, whatever --max-bad-samples said); named in a column it
    was listed (exit 1) and skipped. Now every place gives the same: listed by check-data, skipped by a run with
    --max-bad-samples, refused in one line without it (exit 2 from finetune)."""
    from mimo_sft.data.loader import build_microbatch_iterator
    from mimo_sft.config.schema import DataConfig

    for form in FORMS:
        data = _same_bad_rows(tmp_path, form)
        res = _check_data(tiny_ckpt, data, "--json", "--workers", "0")
        assert res.exit_code == 1, (form, res.output)
        problems = {p["index"]: p["reason"] for p in json.loads(res.stdout)["problems"]}
        assert sorted(problems) == [1, 2] and "2 image placeholder(s)" in problems[1], (form, problems)
        assert "is not base64" in problems[2], (form, problems)
        for max_bad, skipped in ((2, [1, 2]), (0, None)):
            cfg = DataConfig(dataset_path=str(data), seq_length=256, max_bad_samples=max_bad)
            it = build_microbatch_iterator(cfg, model_dir=tiny_ckpt, micro_batch_size=4, canonical_grid=1, dp_size=1,
                                           dp_rank=0, need_pixels=False, seed=0, num_workers=0)
            if skipped:
                assert next(it)["loss_mask"].sum() > 0 and sorted(it.bad_samples) == skipped, form
            else:
                with pytest.raises(UserError, match=r"^sample 1 .*2 image placeholder\(s\)") as err:
                    next(it)
                assert "\n" not in str(err.value)


def test_check_data_refuses_the_data_flags_finetune_refuses(tiny_ckpt, messy):
    """Issue 55 item 2: check-data decoded with --video-fps 0 (and crossed pixel bounds) that validate and finetune
    refuse; it now applies finetune's checks of the data flags first, in finetune's words, exit 2."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    bad = ["--video-fps", "0", "--min-pixels", "100000", "--max-pixels", "1000"]
    res = _check_data(tiny_ckpt, messy, "--workers", "0", *bad)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    validate = check_config(load_config(["--component", "language=dp=1", "--component", "images=dp=1", "--hf-model",
                                         str(tiny_ckpt), "--dataset-path", str(messy), "--seq-length", "256", *bad]))
    wanted = [str(p) for p in validate.problems if p.check == 17]
    assert len(wanted) == 2 and "--video-fps=0.0 must be > 0" in wanted[1], wanted
    assert errors == [f"error: 2 problem(s) in the config: {'; '.join(wanted)}"], res.stderr
