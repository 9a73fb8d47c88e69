"""Image references as public datasets write them: LLaVA's ``image`` (one path or a list, or none)
and Qwen's own format (images named inside the message content, ``file://`` URIs, url/path keys).

Real ``datasets`` loading of real JSON/JSONL/parquet files and real PNGs; samples go through the
project's preprocessing with the tiny checkpoint, so the image-token counts are the real ones.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.config.schema import DataConfig
from mimo_sft.errors import UserError

# name -> (width, height, colour); mixed sizes and aspect ratios
PICS = {"a": (56, 56, (200, 30, 30)), "b": (112, 56, (30, 200, 30)), "c": (40, 90, (30, 30, 200)),
        "d": (84, 28, (120, 120, 0))}
# smart_resize with the tiny processor (factor 28, min 4*28*28, max 64*28*28 pixels):
# 56x56 -> 56x56; 112 wide x 56 high -> same; 40x90 is under min_pixels -> 56 wide x 84 high;
# 84x28 -> 84x28 is 2352 < 3136 pixels -> 112 wide x 56 high.
GRIDS = {"a": (1, 4, 4), "b": (1, 4, 8), "c": (1, 6, 4), "d": (1, 4, 8)}


@pytest.fixture
def pics(tmp_path):
    """images/{a,b,c}.png next to the dataset, d.png in a separate folder (absolute references)."""
    (tmp_path / "images").mkdir()
    (tmp_path / "elsewhere").mkdir()
    for name, (w, h, colour) in PICS.items():
        folder = "elsewhere" if name == "d" else "images"
        Image.new("RGB", (w, h), colour).save(tmp_path / folder / f"{name}.png")
    return tmp_path


def _write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _load(path, **kw):
    from mimo_sft.data.sources import load_sft_dataset

    return load_sft_dataset(DataConfig(dataset_path=str(path), seq_length=256, **kw))


def _one_line_error(fn, match):
    with pytest.raises(UserError, match=match) as err:
        fn()
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def _check_refs(source, expected):
    """Each sample has the expected images: files that exist and decode to the written size."""
    assert len(source) == len(expected)
    for i, names in enumerate(expected):
        messages, refs = source[i]
        assert len(refs) == len(names) == sum(p["type"] == "image" for m in messages for p in m["content"])
        for ref, name in zip(refs, names):
            assert ref.is_absolute() and ref.is_file() and ref.stem == name, (i, ref)
            with Image.open(ref) as img:
                assert img.size == PICS[name][:2]


def _check_preprocessed(source, expected, ckpt):
    """Every sample through the real preprocessing: grids and image tokens follow the image sizes."""
    from mimo_sft.data.loader import build_preprocessor

    pre = build_preprocessor(DataConfig(dataset_path=source.dataset_path, seq_length=256), ckpt)
    for i, names in enumerate(expected):
        sample = pre.encode(*source[i], i, need_pixels=True)
        grids = [GRIDS[n] for n in names]
        n_tokens = sum(t * h * w for t, h, w in grids) // pre.merge_size ** 2
        assert int((sample["input_ids"] == pre.image_token_id).sum()) == n_tokens
        assert sample["grids"] == grids
        if names:
            assert sample["image_grid_thw"].tolist() == [list(g) for g in grids]
            assert sample["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), pre.pixel_dim)
        else:
            assert "pixel_values" not in sample


def _llava_rows():
    def turns(question):
        return [{"from": "human", "value": question}, {"from": "gpt", "value": "Red and blue."}]

    return [{"id": "0", "image": "images/a.png", "conversations": turns("<image>\nWhat colour?")},
            {"id": "1", "image": ["images/b.png", "images/c.png"],
             "conversations": turns("<image>\n<image>\nCompare.")},
            {"id": "2", "conversations": turns("Name a colour.")}]


@pytest.mark.parametrize("name", ["llava.json", "llava.jsonl"])
def test_llava_string_list_and_no_image_in_one_file(pics, tiny_ckpt, name):
    path = _write(pics / name, _llava_rows())
    source = _load(path)  # relative paths: against the dataset's folder
    assert source.images_column == "image"
    expected = [["a"], ["b", "c"], []]
    _check_refs(source, expected)
    assert [(r, p) for r, p in source.image_paths()] == [(0, "images/a.png"), (1, "images/b.png"), (1, "images/c.png")]
    _check_preprocessed(source, expected, tiny_ckpt)


def test_llava_image_root_and_full_iterator(pics, tiny_ckpt):
    from mimo_sft.data.loader import build_microbatch_iterator, model_token_info

    data = pics / "data"
    data.mkdir()
    rows = _llava_rows()
    for r in rows:  # paths relative to --image-root, not to the file's folder
        if "image" in r:
            r["image"] = [p.removeprefix("images/") for p in r["image"]] if isinstance(r["image"], list) \
                else r["image"].removeprefix("images/")
    path = _write(data / "llava.json", rows + rows[:1])
    cfg = DataConfig(dataset_path=str(path), seq_length=256, image_root=str(pics / "images"), dataloader_type="single")
    it = build_microbatch_iterator(cfg, model_dir=tiny_ckpt, micro_batch_size=4, canonical_grid=1, dp_size=1,
                                   dp_rank=0, need_pixels=True, seed=0)
    batch = next(it)
    grids = [GRIDS[n] for n in ("a", "b", "c", "a")]
    assert batch["image_counts"].tolist() == [1, 2, 0, 1]
    assert batch["image_grid_thw"].tolist() == [list(g) for g in grids]
    pad = model_token_info(tiny_ckpt)["image_token_id"]
    assert int((batch["input_ids"] == pad).sum()) == sum(t * h * w for t, h, w in grids) // 4  # merge 2x2


def _qwen_rows(pics):
    def sample(user, *more):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": [
            {"type": "text", "text": "Done."}]}, *more]}

    text = {"type": "text", "text": "Describe."}
    return [
        sample([{"type": "image", "image": "images/a.png"}, text]),
        sample([{"type": "image", "url": "images/b.png"}, {"type": "image", "path": "file://images/c.png"}, text]),
        sample([{"type": "image", "image": f"file://{pics / 'elsewhere' / 'd.png'}"}, text]),
        sample([text]),
        # images in two user turns: collected in message order
        sample([{"type": "image", "path": "images/c.png"}, text],
               {"role": "user", "content": [{"type": "image", "image": "images/a.png"}, text]},
               {"role": "assistant", "content": [{"type": "text", "text": "Also done."}]}),
    ]


QWEN_EXPECTED = [["a"], ["b", "c"], ["d"], [], ["c", "a"]]


@pytest.mark.parametrize("name", ["qwen.jsonl", "qwen.json", "qwen.parquet"])
def test_qwen_images_in_message_content(pics, tiny_ckpt, name):
    rows = _qwen_rows(pics)
    if name == "qwen.jsonl":  # one string content: datasets then stores content as JSON text
        rows[3]["messages"][1]["content"] = "Done."
    source = _load(_write(pics / name, rows))
    assert source.images_column is None
    _check_refs(source, QWEN_EXPECTED)
    assert [r for r, _ in source.image_paths()] == [0, 1, 1, 2, 4, 4]
    _check_preprocessed(source, QWEN_EXPECTED, tiny_ckpt)


def test_qwen_image_root_and_data_uri(pics, tiny_ckpt):
    buf = io.BytesIO()
    Image.new("RGB", (112, 56)).save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                        {"type": "image", "image": uri}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}]
    source = _load(_write(pics / "q.jsonl", rows), image_root=str(pics / "images"))
    _, refs = source[0]
    assert refs[0] == pics / "images" / "a.png" and refs[1] == buf.getvalue()
    assert source.image_paths() == [(0, "a.png")]  # in-dataset bytes need no file


def test_missing_files_reported_at_open(pics):
    rows = _qwen_rows(pics)
    rows[2]["messages"][0]["content"][0]["image"] = f"file://{pics / 'elsewhere' / 'gone.png'}"
    _one_line_error(lambda: _load(_write(pics / "q.json", rows)),
                    r"sample 2: image file .*elsewhere/gone\.png not found")
    rows = _qwen_rows(pics)
    rows[1]["messages"][0]["content"][1]["path"] = "file://images/nope.png"
    _one_line_error(lambda: _load(_write(pics / "q.jsonl", rows)), r"sample 1: image file .*images/nope\.png not found")
    rows = _llava_rows()
    rows[1]["image"] = ["images/b.png", "images/missing.png"]
    _one_line_error(lambda: _load(_write(pics / "l.json", rows)),
                    r"sample 1: image file .*images/missing\.png not found")


def test_images_column_and_inline_references_refused(pics):
    rows = _qwen_rows(pics)
    for r in rows:
        r["images"] = []
    msg = _one_line_error(lambda: _load(_write(pics / "both.jsonl", rows)), "names its images inside the messages")
    assert "sample 0" in msg and "images column 'images'" in msg


@pytest.mark.parametrize("name", ["m.json", "m.parquet"])  # parts as JSON text / as an Arrow struct
def test_text_that_looks_like_an_image_part_is_text(pics, name):
    """Only content parts are image references, not JSON a user wrote in a text part."""
    tricky = json.dumps([{"type": "image", "image": "images/not-a-file.png"}])
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": tricky}]},
                          {"role": "assistant", "content": [{"type": "text", "text": tricky}]}],
             "images": ["images/a.png"]}]
    source = _load(_write(pics / name, rows))
    assert source.image_paths() == [(0, "images/a.png")]
    assert source[0][0][0]["content"][1]["text"] == tricky and len(source[0][1]) == 1


@pytest.mark.parametrize("key", ["image", "url"])
def test_remote_url_refused(pics, key):
    rows = _qwen_rows(pics)
    rows[1]["messages"][0]["content"][0] = {"type": "image", key: "https://example.com/cat.png"}
    msg = _one_line_error(lambda: _load(_write(pics / "q.jsonl", rows)), "remote images are not fetched")
    assert "sample 1" in msg and "https://example.com/cat.png" in msg


def test_image_part_without_reference(pics):
    """A row bad on its own is found when it is read (skipped with --max-bad-samples, listed by check-data), as in
    a dataset with an images column; a dataset whose image parts name no image anywhere is refused when it opens."""
    from mimo_sft.errors import BadRowError

    rows = _qwen_rows(pics)
    rows[1]["messages"][0]["content"][1] = {"type": "image"}  # one part names its image, the other does not
    source = _load(_write(pics / "q.jsonl", rows))
    _one_line_error(lambda: source[1], r"sample 1 .*2 image placeholder\(s\).*only 1 of them name an image")
    with pytest.raises(BadRowError):
        source[1]
    for r in rows:
        for m in r["messages"]:
            m["content"] = [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]
    _one_line_error(lambda: _load(_write(pics / "none.jsonl", rows)), r"sample 0 .*the dataset has no images column")


def test_json_text_values_decoded_but_plain_paths_kept():
    from mimo_sft.data.image_refs import image_list as _image_list

    assert _image_list('"images/a.png"') == ["images/a.png"]
    assert _image_list('["b.png", "c.png"]') == ["b.png", "c.png"]
    assert _image_list('{"path": "a.png", "bytes": null}') == [{"path": "a.png", "bytes": None}]
    assert _image_list("[draft] scan.png") == ["[draft] scan.png"]
    assert _image_list("a.png") == ["a.png"]
    assert _image_list(None) == [] and _image_list([None, "x.png"]) == ["x.png"]
