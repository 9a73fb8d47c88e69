"""Video rows against transformers' own Qwen-VL processors and models (one process, fp32).

Real clips are written with PyAV: H.264 MP4 at 30 fps, VP9 WebM at 12.5 fps (its stream reports 0 frames),
a variable-frame-rate MP4, a clip shorter than one temporal patch. For every family our ``input_ids`` (with
the video placeholders as transformers writes them), ``mm_token_type_ids``, pixels (after the device-side
normalisation), grids, positions and Qwen3-VL's timestamp text equal transformers' processor output exactly;
one training step's loss and every gradient equal transformers' model on a batch that mixes a clip, an
image and a text-only row.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision")  # make install installs it; the suite must not pass without it
from PIL import Image  # noqa: E402

from mimo_sft.data.image_refs import VideoRef
from mimo_sft.data.video import decode_frames  # noqa: E402
from mimo_sft.errors import BadSampleError  # noqa: E402
from mimo_sft.testing.clips import write_clip  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
TOL = 1e-5
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    out = {
        "mp4": write_clip(d / "a.mp4", frames=31, width=97, height=61, fps=30),
        "webm": write_clip(d / "b.webm", frames=20, width=64, height=48, fps=12.5),
        "vfr": write_clip(d / "c.mp4", frames=17, width=80, height=50, fps=24, variable_rate=True),
        "short": write_clip(d / "d.webm", frames=1, width=50, height=40, fps=10),
        "odd_fps": write_clip(d / "e.mp4", frames=50, width=72, height=56, fps=29.97),
    }
    img = d / "page.png"
    Image.fromarray((np.random.RandomState(0).rand(90, 61, 3) * 255).astype("uint8")).save(img)
    out["image"] = img
    (d / "notavideo.mp4").write_text("hello")
    out["bad"] = d / "notavideo.mp4"
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    out = {}
    for fam in FAMILIES:
        d = write_tiny_checkpoint(tmp_path_factory.mktemp(fam) / "m", family=fam, vision_depth=2, text_layers=2,
                                  tie_embeddings=False)
        _perturb(d)
        out[fam] = d
    return out


def _perturb(d: Path) -> None:
    """Norms away from 1 and biases away from 0, so every tensor matters in the gradient check."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p) if ("norm" in name or name.endswith("bias")) else 0.03 * torch.randn_like(p))
    model.save_pretrained(str(d))


def _pre(d, seq_length=1024, **kw):
    from mimo_sft.data.preprocess import SamplePreprocessor

    return SamplePreprocessor(d, seq_length=seq_length, **kw)


def _hf_processor(d: Path):
    """transformers' processor class of the family, from the folder's tokenizer, image and video processors."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor

    from mimo_sft.data.processor import load_processor
    from mimo_sft.data.video import video_processor_for

    model_type = json.loads((d / "config.json").read_text())["model_type"]
    ours = load_processor(d)
    cls = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen3VLProcessor
    return cls(image_processor=ours.image_processor, tokenizer=ours.tokenizer,
               video_processor=video_processor_for(d, model_type), chat_template=ours.chat_template)


MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour is shown in the image?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The colour is red."}]}]


def _reference(pre, proc, clip: VideoRef, image: Path, *, transformers_reads: bool):
    """transformers' processor output for MESSAGES with this clip and image. ``transformers_reads``: the
    frames come from transformers' own ``load_video`` (PyAV) with its processor's ``sample_frames``;
    otherwise (a window, or a WebM transformers cannot read) from our planned indices."""
    from transformers.video_utils import VideoMetadata, load_video

    plan = pre.clips.plan(clip, 0)
    if transformers_reads:
        frames, meta = load_video(str(clip.source), backend="pyav",
                                  sample_indices_fn=functools.partial(proc.video_processor.sample_frames, fps=2))
    else:
        frames = decode_frames(clip, plan.indices, 0)
        meta = VideoMetadata(total_num_frames=plan.window_frames, fps=plan.fps, frames_indices=plan.indices,
                             width=plan.size[1], height=plan.size[0])
    text, _ = pre.render(MESSAGES)
    out = proc(text=[text], images=[Image.open(image).convert("RGB")], videos=[frames], video_metadata=[meta],
               do_sample_frames=False, return_tensors="pt")
    return out, plan, meta


def _compare(pre, ours: dict, hf, d: Path) -> None:
    from mimo_sft.model.pixels import pixel_norm_from, tower_input

    ids = torch.where(ours["mm_token_type_ids"] == 2, torch.tensor(pre.video_token_id), ours["input_ids"])
    assert torch.equal(ids, hf["input_ids"][0])
    assert torch.equal(ours["mm_token_type_ids"], hf["mm_token_type_ids"][0].long())
    norm = pixel_norm_from(d)
    pv, grid = tower_input(ours["pixel_values"], ours["image_grid_thw"], norm, torch.float32, norm.temporal)
    n_vid = int(hf["video_grid_thw"].prod(-1).sum())
    assert torch.equal(grid, torch.cat([hf["video_grid_thw"], hf["image_grid_thw"]]))
    assert float((pv[:n_vid] - hf["pixel_values_videos"]).abs().max()) == 0.0  # max difference 0
    assert torch.allclose(pv[n_vid:], hf["pixel_values"], rtol=0, atol=1e-6)  # the PIL image path (as before)


@pytest.mark.parametrize("family", FAMILIES)
def test_clip_equals_transformers_processor(family, ckpts, clips):
    from transformers import AutoConfig

    d = ckpts[family]
    pre, proc = _pre(d), _hf_processor(d)
    rope = pre._rope
    cases = [("mp4", VideoRef(clips["mp4"]), True), ("vfr", VideoRef(clips["vfr"]), True),
             ("webm", VideoRef(clips["webm"]), False), ("window", VideoRef(clips["odd_fps"], 0.4, 1.5), False)]
    for name, clip, reads in cases:
        hf, plan, meta = _reference(pre, proc, clip, clips["image"], transformers_reads=reads)
        if reads:
            assert plan.indices == [int(i) for i in meta.frames_indices], name
        ours = pre.encode(MESSAGES, [clip, clips["image"]], 0, need_pixels=True)
        _compare(pre, ours, hf, d)
        kw = {"second_per_grid_ts": hf["second_per_grid_ts"]} if "second_per_grid_ts" in hf else {}
        ref_pos, _ = rope.get_rope_index(hf["input_ids"], hf["mm_token_type_ids"], image_grid_thw=hf["image_grid_thw"],
                                         video_grid_thw=hf["video_grid_thw"], **kw)
        assert torch.equal(ours["position_ids"], ref_pos[:, 0]), name
        if family == "qwen2_5_vl":
            assert float(hf["second_per_grid_ts"][0]) == pytest.approx(2 / plan.sampled_fps)
        else:  # one "<t seconds>" per temporal patch, with the window's absolute times
            text = pre.tokenizer.decode(hf["input_ids"][0])
            stamps = [float(s.split(" ")[0][1:]) for s in text.split("<")[1:] if s.endswith(" seconds>")
                      or " seconds>" in s[:16]]
            assert len(plan.timestamps) == plan.grid[0] and stamps, name
    assert AutoConfig.from_pretrained(str(d)).video_token_id == pre.video_token_id


def test_webm_frame_count_and_transformers_failure(ckpts, clips):
    """FFmpeg's VP9 WebM says 0 frames: transformers' reader fails on it, ours counts the packets."""
    from transformers.video_utils import load_video

    from mimo_sft.data.video import read_header

    ref = VideoRef(clips["webm"])
    header = read_header(ref, 0)
    assert header.frames == 20 and header.fps == pytest.approx(12.5)
    odd = read_header(VideoRef(clips["mp4"]), 0)  # H.264 in 4:4:4 keeps the odd sides the processor resizes
    assert (odd.width, odd.height, odd.frames) == (97, 61, 31)
    with pytest.raises(IndexError):
        load_video(str(clips["webm"]), backend="pyav", sample_indices_fn=lambda metadata, **k: np.arange(0))
    frames = decode_frames(ref, [0, 5, 19], 0)
    assert frames.shape == (3, 48, 64, 3) and not np.array_equal(frames[0], frames[1])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_bad_clips_are_one_line(family, ckpts, clips, tmp_path):
    pre = _pre(ckpts[family])
    truncated = tmp_path / "cut.mp4"
    truncated.write_bytes(clips["mp4"].read_bytes()[:600])
    cases = {
        "missing": (VideoRef(tmp_path / "nope.mp4"), "not found"),
        "not a video": (VideoRef(clips["bad"]), "cannot open as a video"),
        "short": (VideoRef(clips["short"]), "fewer than one temporal patch"),
        "window": (VideoRef(clips["mp4"], 5.0, 9.0), "holds no frame"),
    }
    for name, (ref, words) in cases.items():
        with pytest.raises(BadSampleError) as err:
            pre.encode(MESSAGES, [ref, clips["image"]], 7, need_pixels=False)
        assert words in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
    with pytest.raises(BadSampleError):  # truncated: refused at the header or at the pixels, never a traceback
        pre.encode(MESSAGES, [VideoRef(truncated), clips["image"]], 7, need_pixels=True)
    # a clip that cannot fit --seq-length even at the fewest frames and pixels
    tiny = _pre(ckpts[family], seq_length=40, video=_opts(min_pixels=64 * 32 * 32))
    with pytest.raises(BadSampleError, match="even at"):
        tiny.encode(MESSAGES, [VideoRef(clips["mp4"]), clips["image"]], 3, need_pixels=False)


def _opts(**kw):
    from mimo_sft.data.video import VideoOptions

    return VideoOptions(**kw)


def test_long_clip_is_downsampled_to_fit(ckpts, clips):
    """A clip whose sampled frames exceed --seq-length gets fewer frames, and both paths agree on it."""
    d = ckpts["qwen2_5_vl"]
    roomy = _pre(d).clips.plan(VideoRef(clips["odd_fps"]), 0)
    pre = _pre(d, seq_length=roomy.tokens(2) // 2 + 40, video=_opts(fps=8))
    plan = pre.clips.plan(VideoRef(clips["odd_fps"]), 0, token_budget=pre.seq_length - 16)
    assert plan.downsampled and plan.tokens(2) <= pre.seq_length - 16
    text_only = pre.encode(MESSAGES, [VideoRef(clips["odd_fps"]), clips["image"]], 0, need_pixels=False)
    pixels = pre.encode(MESSAGES, [VideoRef(clips["odd_fps"]), clips["image"]], 0, need_pixels=True)
    assert torch.equal(text_only["input_ids"], pixels["input_ids"])
    # the image and the text take room too: the clip is planned again within what they leave
    assert pixels["clips"][0][1] and int(pixels["image_grid_thw"][0, 0]) <= plan.grid[0] * 2
    assert len(pixels["input_ids"]) <= pre.seq_length and int(pixels["mm_token_type_ids"].sum()) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_match_transformers(family, ckpts, clips):
    """Loss and every parameter's gradient after one backward on a batch of a clip row, an image row and a
    text-only row, ours (megatron MimoModel, uint8 pixels normalised on the device) vs transformers (fp32)."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.data.preprocess import collate
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.family import modality_inputs_from_batch
    from mimo_sft.model.pixels import pixel_norm_from, tower_input
    from mimo_sft.model.registry import get_family

    d = ckpts[family]
    pre = _pre(d, seq_length=768)
    rows = [(MESSAGES, [VideoRef(clips["vfr"]), clips["image"]]),
            ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
              {"role": "assistant", "content": [{"type": "text", "text": "A page with a table."}]}], [clips["image"]]),
            ([{"role": "user", "content": [{"type": "text", "text": "Hello, how are you today?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "I am fine, thank you."}]}], [])]
    samples = [pre.encode(m, r, i, need_pixels=True) for i, (m, r) in enumerate(rows)]
    batch = collate(samples, pad_id=pre.pad_id, seq_length=None, need_pixels=True, pixel_dim=pre.pixel_dim)

    # transformers' inputs: the same rows split into images and clips, its own placeholders and positions
    norm = pixel_norm_from(d)
    pv, grid = tower_input(batch["pixel_values"], batch["image_grid_thw"], norm, torch.float32, norm.temporal)
    is_clip = batch["image_grid_thw"][:, 0] > 1
    rows_per = grid.prod(-1)
    item_rows = torch.split(pv, rows_per.tolist())
    hf_ids = torch.where(batch["mm_token_type_ids"] == 2, torch.tensor(pre.video_token_id), batch["input_ids"])
    hf_in = dict(input_ids=hf_ids, attention_mask=batch["attention_mask"].long(), mm_token_type_ids=batch["mm_token_type_ids"],
                 pixel_values=torch.cat([r for r, c in zip(item_rows, is_clip) if not c]), image_grid_thw=grid[~is_clip],
                 pixel_values_videos=torch.cat([r for r, c in zip(item_rows, is_clip) if c]), video_grid_thw=grid[is_clip])
    plan = pre.clips.plan(VideoRef(clips["vfr"]), 0)
    if family == "qwen2_5_vl":
        hf_in["second_per_grid_ts"] = torch.tensor([2 / plan.sampled_fps])
    hf = AutoModelForImageTextToText.from_pretrained(str(d), attn_implementation="eager", dtype=torch.float32)
    hf_labels = torch.where(batch["loss_mask"].bool(), batch["labels"], torch.tensor(-100))
    # transformers shifts labels itself: give it the token at each position whose next token is supervised
    shifted = torch.full_like(hf_labels, -100)
    shifted[:, 1:] = hf_labels[:, :-1]
    ref = hf(**hf_in, labels=shifted).loss
    ref.backward()
    pos_ref, _ = hf.model.get_rope_index(hf_ids, batch["mm_token_type_ids"], image_grid_thw=grid[~is_clip],
                                          video_grid_thw=grid[is_clip], attention_mask=batch["attention_mask"].long(),
                                          **({"second_per_grid_ts": hf_in["second_per_grid_ts"]} if family == "qwen2_5_vl" else {}))
    assert torch.equal(batch["position_ids"][:, batch["attention_mask"]], pos_ref[:, batch["attention_mask"]])

    ours, info = build_single_process_model(str(d))
    per_token, _ = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                        loss_mask=batch["loss_mask"], labels=batch["labels"],
                        modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    assert abs(float(loss) - float(ref)) <= TOL * abs(float(ref))
    adapter = get_family(json.loads((d / "config.json").read_text()), hf_dir=str(d))
    lang = {n: p.grad for n, p in ours.language_model.named_parameters()}
    enc = {n: p.grad for n, p in ours.modality_submodules["images"].encoders[info.encoder_name].named_parameters()}
    ours_hf = adapter.export(lang, enc, hf.config, prefix_style="nested")
    ref_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert ref_grads and set(ref_grads) <= set(ours_hf)
    for name, g in ref_grads.items():
        scale = g.abs().max().clamp_min(1e-12)
        # Qwen3.5's decay path sums terms that cancel: fp32 moves it by up to ~5e-4 of its size (test_qwen3_5.DECAY)
        tol = 1e-3 if name.endswith(DECAY) else TOL
        assert float((ours_hf[name] - g).abs().max() / scale) <= tol, name


def test_check_data_reads_every_clip_once(ckpts, clips, tmp_path):
    """check-data decodes each clip, names the unreadable and too-short ones by sample and file, and counts
    the clips planned smaller to fit --seq-length; bad clips stand in under --max-bad-samples like images."""
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.check import check_dataset

    def row(video):
        return {"messages": [{"role": "user", "content": [{"type": "video", "video": str(video)},
                                                          {"type": "text", "text": "Describe the image."}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "A page."}]}]}

    rows = [row(clips["mp4"]), row(tmp_path / "gone.mp4"), row(clips["short"]), row(clips["odd_fps"]),
            row(clips["bad"])]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = check_dataset(DataConfig(dataset_path=str(data), seq_length=72, video_fps=12.0),
                           model_dir=ckpts["qwen2_5_vl"], workers=0)
    c = report["counts"]
    assert c["samples"] == 5 and c["clips"] == 2 and c["bad_samples"] == 3 and c["clips_downsampled"] >= 1, c
    where = {p["index"]: p for p in report["problems"]}
    assert sorted(where) == [1, 2, 4]
    assert "gone.mp4" in where[1]["path"] and "not found" in where[1]["reason"]
    assert "temporal patch" in where[2]["reason"] and "cannot open as a video" in where[4]["reason"]
    assert report["video"]["fps"] == 12.0 and report["first_sample"]["clips_downsampled"] in (0, 3)


def test_seek_decodes_the_same_frames(tmp_path):
    """Keyframe seeks over long gaps give the frames decoding every frame gives (H.264 and VP9)."""
    from mimo_sft.data.video import SEEK_GAP

    for suffix in (".mp4", ".webm"):
        clip = write_clip(tmp_path / f"long{suffix}", frames=150, width=64, height=48, fps=25, gop=12)
        wanted = [0, 3, 3 + SEEK_GAP + 5, 90, 91, 149]
        a = decode_frames(VideoRef(clip), wanted, 0, seek=True)
        b = decode_frames(VideoRef(clip), wanted, 0, seek=False)
        assert np.array_equal(a, b), suffix
        assert not np.array_equal(a[2], a[3])


def test_streamed_shards_hold_clips_as_a_loaded_file_does(ckpts, tmp_path):
    """Clip rows read in place from parquet shards (paths resolved against the shards' folder) give the tensors
    the same rows give loaded from a JSONL file: tokens, positions, grids and uint8 pixels."""
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.testing.clips import write_video_dataset
    from mimo_sft.testing.demo_data import write_shards

    jsonl = write_video_dataset(tmp_path / "data", samples=14, seed=5)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    # parquet needs one type per field: the frame-list rows (a list where others hold a path) stay in the JSONL test
    rows = [r for r in rows if not any(isinstance(p.get("video"), list) for p in r["messages"][0]["content"])]
    (tmp_path / "data" / "only.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_shards(rows, tmp_path / "data" / "shards", shards=2)
    for p in (tmp_path / "data" / "shards").iterdir():
        p.rename(tmp_path / "data" / p.name)  # beside clips/, as the JSONL is
    loaded = load_sft_dataset(DataConfig(dataset_path=str(tmp_path / "data" / "only.jsonl")))
    streamed = load_sft_dataset(DataConfig(dataset_path=str(tmp_path / "data" / "*.parquet"), streaming=True))
    assert len(loaded) == len(streamed) == len(rows)
    pre = _pre(ckpts["qwen3_vl"], seq_length=512)
    clips_seen = 0
    for i in range(len(rows)):
        a = pre.encode(*loaded[i], i, need_pixels=True)
        b = pre.encode(*streamed[i], i, need_pixels=True)
        clips_seen += len(a["clips"])
        for key in ("input_ids", "labels", "position_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
            assert (key in a) == (key in b) and (key not in a or torch.equal(a[key], b[key])), (i, key)
    assert clips_seen >= 6


def test_webdataset_clip_members(ckpts, clips, tmp_path):
    """A tar sample's ``<key>.mp4`` member is its video part's clip (as ``<key>.png`` is an image part's image):
    read in place, it gives the tensors the same clip gives named by path."""
    import io
    import tarfile

    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.sources import load_sft_dataset

    row = {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "A bar moves."}]}]}
    with tarfile.open(tmp_path / "shard-00000.tar", "w") as tar:
        for name, data in (("s0.json", json.dumps(row).encode()), ("s0.mp4", clips["mp4"].read_bytes()),
                           ("s1.json", json.dumps(row).encode()), ("s1.webm", clips["webm"].read_bytes())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    source = load_sft_dataset(DataConfig(dataset_path=str(tmp_path / "shard-00000.tar"), dataloader_type="single"))
    pre = _pre(ckpts["qwen2_5_vl"], seq_length=512)
    for i, clip in enumerate((clips["mp4"], clips["webm"])):
        messages, refs = source[i]
        assert isinstance(refs[0], VideoRef) and isinstance(refs[0].source, bytes)
        a = pre.encode(messages, refs, i, need_pixels=True)
        b = pre.encode(messages, [VideoRef(clip)], i, need_pixels=True)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
