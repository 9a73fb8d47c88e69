"""Preprocessing agrees with transformers (processor, assistant masks, get_rope_index), and the
pixel and metadata-only paths give identical text tensors."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from data_fixtures import demo_data, tiny_ckpt  # noqa: F401  (session fixtures)
from mimo_sft.model.pixels import float_patches, pixel_norm_from
from mimo_sft.config.schema import DataConfig
from mimo_sft.errors import UserError

TEXT_KEYS = ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids", "mm_token_type_ids",
             "image_counts", "sample_ids")


@pytest.fixture(scope="module")
def parts(tiny_ckpt, demo_data):
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset

    # compared with the PIL image processor below (tests/test_image_backend.py compares both backends)
    cfg = DataConfig(dataset_path=str(demo_data), seq_length=192, image_backend="pil")
    return cfg, load_sft_dataset(cfg), build_preprocessor(cfg, tiny_ckpt)


def _kinds(source):
    """Indices of a single-image, a multi-image and a text-only sample."""
    found = {}
    for i in range(len(source)):
        n = len(source[i][1])
        found.setdefault(min(n, 2), i)
    assert set(found) == {0, 1, 2}, "demo data should mix text-only, single and multi-image samples"
    return [found[1], found[2], found[0]]


def _hf_messages(messages, refs):
    imgs = iter(Image.open(io.BytesIO(r)).convert("RGB") for r in refs)
    return [{"role": m["role"], "content": [dict(p, image=next(imgs)) if p["type"] == "image" else p for p in m["content"]]}
            for m in messages]


def test_matches_transformers_processor(parts, tiny_ckpt):
    from mimo_sft.data.processor import load_processor

    cfg, source, pre = parts
    proc = load_processor(tiny_ckpt)
    for i in _kinds(source):
        messages, refs = source[i]
        ours = pre.encode(messages, refs, i, need_pixels=True)
        hf = proc.apply_chat_template(_hf_messages(messages, refs), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, return_tensors="pt")
        ids = hf["input_ids"][0]
        assert torch.equal(ours["input_ids"], ids)
        assert torch.equal(ours["mm_token_type_ids"], hf["mm_token_type_ids"][0].long())
        amask = torch.as_tensor(hf["assistant_masks"][0]).bool()
        # loss_mask is the assistant mask shifted by one; labels are the next token there
        assert torch.equal(ours["loss_mask"][:-1].bool(), amask[1:]) and ours["loss_mask"][-1] == 0
        sup = ours["loss_mask"].bool()
        assert sup.any()
        assert torch.equal(ours["labels"][:-1][sup[:-1]], ids[1:][sup[:-1]])
        assert (ours["labels"][~sup] == pre.pad_id).all()
        if refs:
            assert ours["pixel_values"].dtype == torch.uint8  # normalised on the device (model.pixels)
            assert torch.allclose(float_patches(ours["pixel_values"], pixel_norm_from(tiny_ckpt)), hf["pixel_values"],
                                  rtol=0, atol=1e-6)
            assert torch.equal(ours["image_grid_thw"], hf["image_grid_thw"])
        else:
            assert "pixel_values" not in ours


def test_position_ids_equal_transformers_get_rope_index(parts, tiny_ckpt):
    from transformers import AutoModelForImageTextToText

    from mimo_sft.data.preprocess import collate

    cfg, source, pre = parts
    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt).eval()
    idx = _kinds(source)
    samples = [pre.encode(*source[i], i, need_pixels=True) for i in idx]
    batch = collate(samples, pad_id=pre.pad_id, seq_length=pre.seq_length, need_pixels=True, pixel_dim=pre.pixel_dim)
    ref, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                        image_grid_thw=batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    assert torch.equal(batch["position_ids"], ref)
    # images really get 3-D positions (not a plain arange), so the comparison means something
    assert not torch.equal(batch["position_ids"][1], batch["position_ids"][2])
    # and the reference forward consumes the batch as-is
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                    pixel_values=float_patches(batch["pixel_values"], pixel_norm_from(tiny_ckpt)),
                    image_grid_thw=batch["image_grid_thw"],
                    mm_token_type_ids=batch["mm_token_type_ids"])
    assert torch.isfinite(out.logits).all()


def _iterator(cfg, ckpt, **kw):
    from mimo_sft.data.loader import build_microbatch_iterator

    args = dict(model_dir=ckpt, micro_batch_size=4, canonical_grid=2, dp_size=2, dp_rank=1, need_pixels=True, seed=11)
    args.update(kw)
    return build_microbatch_iterator(cfg, **args)


def test_pixel_and_metadata_paths_agree(parts, tiny_ckpt):
    cfg, source, pre = parts
    cfg = DataConfig(dataset_path=cfg.dataset_path, seq_length=cfg.seq_length, dataloader_type="cyclic")
    pix = _iterator(cfg, tiny_ckpt, need_pixels=True, source=source, preprocessor=pre)
    meta = _iterator(cfg, tiny_ckpt, need_pixels=False, source=source, preprocessor=pre)
    whole = _iterator(cfg, tiny_ckpt, need_pixels=False, scalable_dp=False, source=source, preprocessor=pre)
    saw_images = 0
    for _ in range(6):
        a, b, c = next(pix), next(meta), next(whole)
        assert "pixel_values" not in b and "image_grid_thw" not in b
        for k in TEXT_KEYS:
            assert torch.equal(a[k], b[k]), k
            assert torch.equal(a[k], c[k]), k
        assert a["input_ids"].shape == (2, cfg.seq_length)
        merge2 = pre.merge_size ** 2
        assert int(a["image_grid_thw"].prod(-1).sum()) // merge2 == int((a["input_ids"] == pre.image_token_id).sum())
        assert a["pixel_values"].shape == (int(a["image_grid_thw"].prod(-1).sum()), pre.pixel_dim)
        assert int(a["image_counts"].sum()) == a["image_grid_thw"].shape[0]
        assert a["labels"].min() >= 0
        saw_images += int(a["image_counts"].sum())
    assert saw_images > 0


def test_metadata_matches_batches(parts, tiny_ckpt):
    from mimo_sft.data.loader import sample_metadata

    cfg, source, pre = parts
    metas = sample_metadata(cfg, model_dir=tiny_ckpt, indices=range(8), source=source, preprocessor=pre)
    for m in metas:
        s = pre.encode(*source[m.index], m.index, need_pixels=True)
        assert m.n_tokens == s["n_tokens"] == len(s["input_ids"])
        assert m.image_patches == [int(g.prod()) for g in s.get("image_grid_thw", torch.zeros(0, 3))]
        assert m.image_tokens == int((s["input_ids"] == pre.image_token_id).sum())


def _write_long_prompt_dataset(path, n=6):
    import datasets

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray((rng.random((200, 200, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    rows = []
    for i in range(n):
        long = i % 2 == 0  # even samples: long text BEFORE the image -> image tokens cut
        user = [{"type": "text", "text": "word " * (150 if long else 5)}, {"type": "image", "text": None}]
        rows.append({"messages": [{"role": "user", "content": user},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"answer {i} " * 40}]}],
                     "images": [{"bytes": buf.getvalue(), "path": None}]})
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_truncation_drop_error_and_text_cut(tmp_path, tiny_ckpt, caplog):
    path = _write_long_prompt_dataset(tmp_path / "long.parquet")
    cfg = DataConfig(dataset_path=str(path), seq_length=128, on_truncation="drop")
    it = _iterator(cfg, tiny_ckpt, micro_batch_size=2, canonical_grid=1, dp_size=1, dp_rank=0, need_pixels=False,
                   num_workers=0)  # the warning is logged where the sample is encoded: in this process
    with caplog.at_level(logging.WARNING, logger="mimo_sft.data"):
        b = next(it)
    # sample 0 is dropped and replaced by sample 1 (the next that fits); sample 1 itself follows
    assert b["sample_ids"].tolist() == [1, 1]
    assert "dropped sample 0" in caplog.text and "1 dropped so far" in caplog.text
    # sample 1 keeps its image but its long answer is cut at seq_length (text truncation is allowed)
    assert bool(b["attention_mask"].all())
    assert int(b["mm_token_type_ids"][0].sum()) == 49  # 200x200 -> 196x196 -> 14x14 patches / 2x2 merge
    assert b["loss_mask"][0, -1] == 1.0  # the target of the last position is still the answer
    cfg_err = DataConfig(dataset_path=str(path), seq_length=128, on_truncation="error")
    it = _iterator(cfg_err, tiny_ckpt, micro_batch_size=2, canonical_grid=1, dp_size=1, dp_rank=0, need_pixels=False)
    with pytest.raises(UserError, match=r"sample 0: .*--seq-length.*--on-truncation") as err:
        next(it)
    assert "\n" not in str(err.value)


def test_metadata_path_never_decodes_pixels(parts, tiny_ckpt, monkeypatch):
    """Fault injection: any pixel decode raises; the metadata-only path must not notice."""
    import PIL.ImageFile

    from mimo_sft.data.loader import sample_metadata

    cfg, source, pre = parts

    def boom(self, *a, **k):
        raise AssertionError("pixels decoded on the metadata-only path")

    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", boom)
    it = _iterator(cfg, tiny_ckpt, need_pixels=False, source=source, preprocessor=pre)
    assert sum(int(next(it)["image_counts"].sum()) for _ in range(4)) > 0
    assert len(sample_metadata(cfg, model_dir=tiny_ckpt, indices=range(6), source=source, preprocessor=pre)) == 6
    with pytest.raises(AssertionError, match="pixels decoded"):  # the pixel path does decode
        pre.encode(*source[_kinds(source)[0]], 0, need_pixels=True)


def test_exif_rotation_agrees_on_both_paths(tmp_path, tiny_ckpt, parts):
    from PIL import ImageOps

    from mimo_sft.data.processor import load_processor

    _, _, pre = parts
    img = Image.new("RGB", (60, 130), (10, 200, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: displayed as 130 x 60
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes())
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]
    meta = pre.encode(messages, [buf.getvalue()], 0, need_pixels=False)
    pix = pre.encode(messages, [buf.getvalue()], 0, need_pixels=True)
    assert meta["grids"] == pix["grids"] == [tuple(pix["image_grid_thw"][0].tolist())]
    t, h, w = meta["grids"][0]
    assert w > h  # rotated: wider than tall
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue())))
    ref = load_processor(tiny_ckpt).image_processor(images=[upright], return_tensors="pt")
    assert torch.allclose(float_patches(pix["pixel_values"], pixel_norm_from(tiny_ckpt)), ref["pixel_values"],
                          rtol=0, atol=1e-6)
    for k in ("input_ids", "labels", "position_ids"):
        assert torch.equal(meta[k], pix[k])


def test_sample_metadata_with_workers_matches_in_process(parts, tiny_ckpt):
    from mimo_sft.data.loader import dataset_stats, sample_metadata

    cfg, source, pre = parts
    a = sample_metadata(cfg, model_dir=tiny_ckpt, source=source, preprocessor=pre)
    b = sample_metadata(cfg, model_dir=tiny_ckpt, source=source, preprocessor=pre, num_workers=2)
    assert a == b and [m.index for m in a] == list(range(len(source)))
    stats = dataset_stats(cfg, model_dir=tiny_ckpt, source=source, preprocessor=pre)
    assert stats["samples"] == len(source) and stats["text_only"] > 0 and stats["multi_image"] > 0
    # documents are several times larger than receipts
    assert stats["patches_per_image_max"] >= 4 * stats["patches_per_image_min"]


def test_text_only_micro_batch_on_an_encoder_rank(parts):
    from mimo_sft.data.preprocess import collate

    cfg, source, pre = parts
    i = _kinds(source)[2]
    s = pre.encode(*source[i], i, need_pixels=True)
    batch = collate([s, s], pad_id=pre.pad_id, seq_length=None, need_pixels=True, pixel_dim=pre.pixel_dim)
    assert batch["pixel_values"].shape == (0, pre.pixel_dim) and batch["image_grid_thw"].shape == (0, 3)
    assert batch["input_ids"].shape == (2, len(s["input_ids"]))  # no --pad-to-seq-length: longest in batch
    # text-only positions are a plain arange on all three axes
    assert torch.equal(batch["position_ids"][:, 0], torch.arange(len(s["input_ids"])).expand(3, -1))
    assert pre.min_tokens_for_one_image() > pre.max_pixels // (pre.patch_size * pre.merge_size) ** 2


def test_an_unset_max_pixels_is_lowered_to_fit_the_seq_length(tiny_ckpt, demo_data, tmp_path):  # noqa: F811
    """Issue 44 item 2: a checkpoint whose processor allows 16.8 Mpx (Qwen3-VL, Qwen3.5) at --seq-length 2048 was
    refused; with --max-pixels unset the limit becomes the largest that fits one image with the template's
    tokens, said by validate and the banner and recorded in the checkpoint. An explicit one is still refused."""
    import json
    import shutil

    from mimo_sft.config.loader import load_config
    from mimo_sft.data.loader import check_fits, fitted_pixels_note
    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.validate import check_config

    big = tmp_path / "big"
    shutil.copytree(tiny_ckpt, big)
    proc = json.loads((big / "processor_config.json").read_text())
    proc["image_processor"]["size"]["longest_edge"] = 16_777_216
    (big / "processor_config.json").write_text(json.dumps(proc))
    pre = SamplePreprocessor(big, seq_length=2048)
    factor = pre.patch_size * pre.merge_size
    assert pre.processor_max_pixels == 16_777_216 and pre.max_pixels == pre.fitted_max_pixels < 16_777_216
    assert pre.min_tokens_for_one_image() == 2048  # the largest that fits, to the merged patch
    assert SamplePreprocessor(big, seq_length=2048, max_pixels=pre.max_pixels + factor ** 2).min_tokens_for_one_image() > 2048
    # a page of 3000x4000 becomes a grid whose tokens fit
    t, h, w = pre.grid_for_size(4000, 3000)
    assert t * h * w // pre.merge_size ** 2 <= 2048 - 20
    assert pre.fitted_note() == (f"images above {pre.max_pixels / 1e6:.3g} Mpx are downscaled to fit --seq-length 2048 "
                                 f"(the checkpoint allows 16.8 Mpx); set --max-pixels to choose another limit")
    source = load_sft_dataset(DataConfig(dataset_path=str(demo_data)))
    check_fits(source, pre, micro_batch_size=2)
    with pytest.raises(UserError, match="too short for one image at --max-pixels 16777216"):
        check_fits(source, SamplePreprocessor(big, seq_length=2048, max_pixels=16_777_216), micro_batch_size=2)
    cfg = load_config(["--hf-model", str(big), "--dataset-path", str(demo_data), "--seq-length", "2048",
                       "--component", "language=dp=1", "--component", "images=dp=1"])
    assert fitted_pixels_note(cfg.data, str(big)) == pre.fitted_note()
    assert pre.fitted_note() in [n.message for n in check_config(cfg).notes]
    assert SamplePreprocessor(tiny_ckpt, seq_length=2048).fitted_max_pixels is None  # its own limit fits
