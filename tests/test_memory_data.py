"""The memory forecast from the data (issue 53 item 6): check 23 on the largest micro-batch a dataset's rows can
form (``memory.from_data``), from check-data's per-row counts (``data.cost_file``).

* the attention-padding bound: every segment's padded slots under ``model.segments``' real grouping, in any
  company, are within ``segment_slots`` (and the plain ``(1 + SLACK) n`` is not: the negative control); windows
  and whole images of transformers' own window layout within ``image_slots``, whose window count is exact;
* the bound is an upper bound of every micro-batch the sampler can form from a real dataset (every choice of
  dataset indices, dropped rows replaced by the next one as training does), and equal to the heaviest for the
  plain sums (tokens, image tokens, patches);
* at Qwen2.5-VL-3B's real width, the bytes autograd saves for the data's heaviest micro-batch (packed and padded
  rows, the CPU's and CUDA's norm kernels; the tower's windowed and full-attention blocks and merger) are at or
  below the forecast's activations and at least 1/1.2 of them;
* check 23: the data's figure is in force where check-data wrote the counts, with the worst case as one note; a
  refusal stays one line naming the flag; without counts (or with rows check-data could not count) the worst
  case stays, and its refusal says how to forecast the data.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_fixtures import demo_dataset_dir, tiny_checkpoint_dir
from mimo_sft.config.loader import load_config
from mimo_sft.memory import from_data as fd

#: a --seq-length at which the demo set's large pages (at the tiny processor's 50,176 pixels) drop
SEQ = 72


def _real_slots(lengths) -> int:
    """Padded slots of ``lengths`` as ``model.segments`` lays them out (its own grouping)."""
    from mimo_sft.model.segments import _aligned, group_segments

    lengths = [n for n in lengths if n > 0]
    return sum(len(g) * _aligned(max(lengths[i] for i in g)) for g in group_segments(lengths)) if lengths else 0


# ---- the padding bound ---------------------------------------------------------------------------------
def test_the_grouping_constants_are_model_segments():
    from mimo_sft.model import segments

    assert (fd.ALIGN, fd.SLACK, fd.SMALL_WORK) == (segments.ALIGN, segments.SLACK, segments.SMALL_WORK)
    assert fd.SHORT == 360 and 2 * fd.SHORT ** 2 <= fd.SMALL_WORK < 2 * (fd.SHORT + fd.ALIGN) ** 2


def test_segment_bound_holds_in_any_company():
    rng = random.Random(0)
    ranges = [(1, 40), (40, 400), (300, 600), (400, 6000)]
    worst_plain = 0.0
    for _ in range(600):
        lengths = [rng.randint(*rng.choice(ranges)) for _ in range(rng.randint(1, 120))]
        real = _real_slots(lengths)
        assert real <= int(fd.segment_slots(lengths).sum()), lengths
        worst_plain = max(worst_plain, real / (1.25 * sum(lengths)))
    for lengths in ([360] + [8] * 40, [300, 20], [64] * 64 + [4] * 30, [1] * 500, [361, 361], [5000, 1]):
        assert _real_slots(lengths) <= int(fd.segment_slots(lengths).sum()), lengths
    # negative control: (1 + SLACK) x the real positions alone is no bound (short segments share a wide row)
    assert _real_slots([300, 20]) > 1.25 * 320 and worst_plain > 1.0


@pytest.fixture(scope="module")
def q3b(tmp_path_factory):
    """Qwen2.5-VL-3B's config.json (windows of 112 px, four full-attention blocks), no weights."""
    from mimo_sft.testing.tiny_checkpoint import preset_config

    out = tmp_path_factory.mktemp("q3b")
    preset_config("qwen2.5-vl-3b").save_pretrained(str(out))
    return str(out)


def test_window_and_image_bounds_hold_on_transformers_layout(q3b):
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import VisionDims
    from mimo_sft.testing.saved_bytes import image_segments, vision_block

    _, vcfg = vision_block(q3b, dtype=torch.bfloat16)
    v = VisionDims.from_config(read_hf_config(q3b))
    assert (fd.window_tiles(v), v.full_attention_blocks, v.depth) == (4, 4, 32)
    rng = random.Random(1)
    sizes = [(4, 4), (4, 6), (6, 4), (8, 8), (10, 14), (16, 16), (42, 30), (84, 120), (36, 44), (2 * 37, 2 * 21)]
    for trial in range(200):
        grids = [[rng.choice([1, 1, 1, 2, 3]), *rng.choice(sizes)] for _ in range(rng.randint(1, 6))]
        windows, images = image_segments(vcfg, grids)
        win_bound, full_bound = fd.image_slots(v, np.array(grids))
        tiles = sum(t * -(-(h // 2) // 4) * -(-(w // 2) // 4) for t, h, w in grids)
        assert len(windows) == tiles, grids  # the window count is transformers' own
        assert _real_slots(windows) <= win_bound.sum() and _real_slots(images) <= full_bound.sum(), grids


@pytest.mark.parametrize("segments", [[64, 4], [32, 16, 8, 4], [500], [64] * 7 + [4]])
def test_a_padded_vision_block_keeps_what_the_padding_terms_say(q3b, segments):
    """At Qwen2.5-VL's real tower width: a block over padded segments keeps the per-patch terms plus
    ``vision_padding_bytes`` of its real slots, to the byte."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory import activations as act
    from mimo_sft.memory.dims import VisionDims
    from mimo_sft.testing.saved_bytes import vision_block, vision_block_saved

    block, vcfg = vision_block(q3b, dtype=torch.bfloat16)
    v = VisionDims.from_config(read_hf_config(q3b))
    patches = sum(segments)
    measured = vision_block_saved(block, vcfg, patches, dtype=torch.bfloat16, segments=segments)
    formula = sum(act.vision_block_terms(v, b=2).values()) * patches
    assert measured == formula + act.vision_padding_bytes(v, b=2, patches=patches, slots=_real_slots(segments))


@pytest.mark.parametrize("segments", [[300, 212], [200, 10, 5], [1000, 990]])
def test_a_packed_decoder_layer_keeps_at_most_the_padding_terms(q3b, segments):
    """One packed decoder layer at Qwen2.5-VL-3B's width (CUDA's norms) keeps at most the per-token terms plus
    ``language_slot_bytes`` per padded slot beyond the tokens."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory import activations as act
    from mimo_sft.memory.dims import TextDims
    from mimo_sft.testing.saved_bytes import language_layer, language_layer_saved

    block, cfg = language_layer(q3b, dtype=torch.bfloat16)
    d = TextDims.from_config(read_hf_config(q3b))
    tokens = sum(segments)
    measured = language_layer_saved(block, cfg, tokens, dtype=torch.bfloat16, device="cuda", segments=segments)
    per_token = sum(act.language_layer_terms(d, tp=1, sp=False, b=2, device="cuda").values())
    pads = _real_slots(segments) - tokens
    assert pads > 0
    assert measured <= per_token * tokens + act.language_slot_bytes(d, tp=1, b=2) * pads <= 1.01 * measured


def test_top_sum_is_the_largest_sum_the_copies_allow():
    rng = np.random.default_rng(0)
    for _ in range(200):
        vals = [rng.integers(0, 50, rng.integers(1, 6)) for _ in range(rng.integers(1, 3))]
        cops = [rng.integers(1, 3, len(v)) for v in vals]
        batch = int(rng.integers(1, 5))
        pool = [int(x) for v, c in zip(vals, cops) for x, k in zip(v, c) for _ in range(int(k))]
        if len(pool) < batch:
            continue
        best = max(sum(c) for c in itertools.combinations(pool, batch))
        assert fd.top_sum(vals, cops, batch) == best


# ---- every micro-batch of a real dataset -----------------------------------------------------------------
def _cfg(model, data, costs, *extra):
    return load_config(["--hf-model", str(model), "--dataset-path", str(data), "--cost-dir", str(costs),
                        "--allow-random-init", "--dtype", "bf16", "--seq-length", str(SEQ),
                        "--component", "language=dp=1", "--component", "images=dp=1", *extra])


def _write_costs(cfg):
    from mimo_sft.data.check import check_dataset
    from mimo_sft.validate import data_row_counts

    check_dataset(cfg.data, model_dir=cfg.model.hf_model, workers=0, write_costs=True)
    counts, why = data_row_counts(cfg)
    assert counts is not None, why
    return counts


@pytest.fixture(scope="module")
def tiny_counts(tmp_path_factory):
    """The demo set's rows counted by check-data at a --seq-length where some drop (image tokens past it)."""
    root = tmp_path_factory.mktemp("tiny_counts")
    cfg = _cfg(tiny_checkpoint_dir(), demo_dataset_dir(), root / "costs", "--max-pixels", "50176")
    return cfg, _write_costs(cfg)


def _encoded(cfg) -> list:
    """Each dataset row as training's text path encodes it: ``(real tokens, image tokens, grids)``, or None where
    its image tokens pass --seq-length (dropped)."""
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.preprocess import TruncatedImageError
    from mimo_sft.data.sources import load_sft_dataset

    source, pre = load_sft_dataset(cfg.data), build_preprocessor(cfg.data, cfg.model.hf_model)
    out = []
    for i in range(len(source)):
        try:
            s = pre.encode(*source[i], i, need_pixels=False)
            out.append((len(s["input_ids"]), int((s["input_ids"] == pre.image_token_id).sum()),
                        [list(g) for g in s["grids"]]))
        except TruncatedImageError:
            out.append(None)
    return out


def _effective_rows(encoded: list) -> list:
    """Each dataset index -> the row training encodes for it (a dropped row: the next that fits)."""
    out = []
    for i in range(len(encoded)):
        j = i
        while encoded[j] is None:
            j = (j + 1) % len(encoded)
        out.append(encoded[j])
    return out


def test_the_cost_files_hold_the_text_paths_grids(tiny_counts):
    cfg, counts = tiny_counts
    encoded = _encoded(cfg)
    src = counts.sources[0]
    got = [(int(src.tokens[k]), int(src.image_tokens[k]), [[int(x) for x in g] for g in src.grids[src.image_rows == k]])
           for k in range(len(src))]
    assert got == [e for e in encoded if e is not None]
    assert None in encoded and int(src.stands_for.sum()) == len(encoded)  # rows dropped, each stood in for
    stands = [1 + sum(1 for _ in itertools.takewhile(lambda e: e is None, reversed(encoded[:i])))
              for i, e in enumerate(encoded) if e is not None]
    assert src.stands_for[1:].tolist() == stands[1:]  # (the first row also stands for the dropped rows at the end)


@pytest.mark.parametrize("batch", [2, 3])
def test_the_bound_covers_every_micro_batch_the_sampler_can_form(tiny_counts, batch):
    """Every choice of ``batch`` dataset indices (what any order can put in one micro-batch), each encoded as
    training encodes it: its sums and its padded slots under the real grouping stay within the workload, and the
    plain sums reach it."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import VisionDims
    from mimo_sft.testing.saved_bytes import image_segments, vision_block
    from mimo_sft.validate import check_config

    cfg, counts = tiny_counts
    train = dataclasses.replace(cfg.train, micro_batch_size=batch, global_batch_size=batch)
    cfg = dataclasses.replace(cfg, train=train)
    layout = check_config(cfg, row_counts=None).layout
    wl = fd.data_workload(cfg, layout, read_hf_config(cfg.model.hf_model), counts)
    merge = VisionDims.from_config(read_hf_config(cfg.model.hf_model)).merge
    _, vcfg = vision_block(cfg.model.hf_model, dtype=torch.float32)
    rows = _effective_rows(_encoded(cfg))
    best = dict.fromkeys(("language_tokens", "image_tokens", "image_patches"), 0)
    for pick in itertools.combinations(range(len(rows)), batch):
        mb = [rows[i] for i in pick]
        grids = [g for r in mb for g in r[2]]
        windows, images = image_segments(vcfg, grids) if grids else ([], [])
        seen = {"language_tokens": sum(r[0] for r in mb), "image_tokens": sum(r[1] for r in mb),
                "image_patches": sum(r[1] for r in mb) * merge ** 2}
        for key, value in seen.items():
            assert value <= getattr(wl, key), (pick, key)
            best[key] = max(best[key], value)
        assert _real_slots([r[0] for r in mb]) <= wl.language_slots, pick
        assert _real_slots(windows) <= wl.window_slots and _real_slots(images) <= wl.image_slots, pick
    assert best == {key: getattr(wl, key) for key in best}  # the heaviest micro-batch is the bound


# ---- at real width: what autograd keeps for the heaviest micro-batch ---------------------------------------
@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The tiny checkpoint's tokenizer and processor with Qwen2.5-VL-3B's language and vision sizes (what saved
    bytes depend on), and the GPU benchmark's kind of rows (1-2 pages, answers of 20-400 words) at up to 0.2 Mpx a
    page, counted by check-data."""
    from mimo_sft.testing.demo_data import write_document_rows
    from mimo_sft.testing.tiny_checkpoint import preset_config

    root = tmp_path_factory.mktemp("wide")
    model = root / "model"
    shutil.copytree(tiny_checkpoint_dir(), model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "config.json").read_text())
    real = preset_config("qwen2.5-vl-3b").to_dict()
    config["vision_config"] = real["vision_config"]
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    config["text_config"] = {**real["text_config"], **{k: config["text_config"][k] for k in keep}}
    (model / "config.json").write_text(json.dumps(config))
    data = write_document_rows(root / "docs.parquet", 24, seed=2)
    cfg = _cfg(model, data, root / "costs", "--max-pixels", "200704", "--seq-length", "2048",
               "--micro-batch-size", "2", "--global-batch-size", "2")
    return cfg, _write_costs(cfg)


def _forecast(cfg, counts, device):
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.forecast import forecast_memory
    from mimo_sft.validate import check_config

    layout = check_config(cfg, row_counts=None).layout
    return forecast_memory(cfg, layout, read_hf_config(cfg.model.hf_model), counts=counts, device=device)


@pytest.mark.parametrize("device, packed", [("cpu", True), ("cuda", True), ("cuda", False)])
def test_language_forecast_against_saved_bytes_at_real_width(wide, device, packed):
    from mimo_sft.testing import worst_batch as wb

    cfg, counts = wide
    if not packed:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, in_batch_packing=False))
    forecast = _forecast(cfg, counts, device).modules["language"].terms["activations"]
    batch = wb.worst_batch(counts, language_rows=2, vision_rows=2)
    assert len(set(batch.lengths)) == 2 and min(batch.lengths) > 700  # two real samples, long enough to matter
    measured = wb.language_saved(cfg.model.hf_model, batch, dtype=torch.bfloat16, device=device, packed=packed,
                                 seq_length=cfg.data.seq_length)
    assert measured <= forecast <= 1.2 * measured, (forecast, measured, forecast / measured)


def test_vision_forecast_against_saved_bytes_at_real_width(wide):
    from mimo_sft.testing import worst_batch as wb

    cfg, counts = wide
    forecast = _forecast(cfg, counts, "cuda").modules["images"].terms["activations"]
    batch = wb.worst_batch(counts, language_rows=2, vision_rows=2)
    assert len(batch.grids) == 4  # two rows of two pages: windows at their edges, whole images of unequal size
    measured = wb.vision_saved(cfg.model.hf_model, batch, dtype=torch.bfloat16)
    assert measured <= forecast <= 1.2 * measured, (forecast, measured, forecast / measured)


# ---- check 23 --------------------------------------------------------------------------------------------
def _validate(*args):
    from typer.testing import CliRunner

    from mimo_sft.cli import app

    return CliRunner().invoke(app, ["validate", "--quiet", *args])


def _args(cfg, costs, gb):
    return ["--hf-model", cfg.model.hf_model, "--dataset-path", cfg.data.dataset_path, "--cost-dir", str(costs),
            "--allow-random-init", "--seq-length", str(cfg.data.seq_length), "--max-pixels", str(cfg.data.max_pixels),
            "--component", "language=dp=1", "--component", "images=dp=1", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--dtype", "bf16", "--gpu-memory-gb", str(gb)]


def test_check_23_takes_the_data_and_keeps_the_worst_case_as_a_note(wide):
    cfg, counts = wide
    res = _validate(*_args(cfg, cfg.data.cost_dir, 1000), "--json")
    out = json.loads(res.output)
    data_gb = sum(m["peak_bytes"] for m in out["memory"].values()) / 1024 ** 3
    worst_gb = sum(out["memory_worst_case"]["gpu_peaks"].values()) / 1024 ** 3
    assert out["memory_workload"].startswith("this data: the largest micro-batch its 24 rows can form")
    assert data_gb < worst_gb / 1.2, (data_gb, worst_gb)
    budget = round((data_gb + worst_gb) / 2)
    fits = _validate(*_args(cfg, cfg.data.cost_dir, budget))
    assert fits.exit_code == 0, fits.output
    note = next(line for line in fits.output.splitlines() if line.startswith("note [23]"))
    assert note.startswith("note [23] the worst case a sample could reach") and "this data needs at most" in note
    assert "memory, not in force" in fits.output
    # below the data's figure: one line naming the flag, said to be this data's
    low = _validate(*_args(cfg, cfg.data.cost_dir, max(1, int(data_gb) - 2)), "--json")
    problems = [p for p in json.loads(low.output)["problems"] if p.startswith("[23]")]
    assert low.exit_code == 2 and len(problems) == 1 and "\n" not in problems[0]
    assert "exceeds --gpu-memory-gb" in problems[0] and "(this data's largest micro-batch)" in problems[0]


def test_without_counts_the_worst_case_stays_and_says_how_to_forecast_the_data(wide, tmp_path):
    cfg, _ = wide
    res = _validate(*_args(cfg, tmp_path / "none", 60), "--json")
    out = json.loads(res.output)
    assert out["memory_worst_case"] is None and out["memory_workload"].startswith("worst case")
    line = next(p for p in out["problems"] if p.startswith("[23]"))
    assert "`mimo-sft check-data --write-costs` with these flags" in line


def test_rows_check_data_could_not_count_keep_the_worst_case(wide, tmp_path):
    """A row check-data could not encode (the injected fault: its count marked unknown in a copy of the file)."""
    from mimo_sft.data.cost_file import UNKNOWN

    cfg, counts = wide
    costs = tmp_path / "costs"
    shutil.copytree(cfg.data.cost_dir, costs)
    path = Path(counts.files[0].replace(str(cfg.data.cost_dir), str(costs)))
    table = np.load(path)
    table[5, 0] = UNKNOWN
    np.save(path, table)
    out = json.loads(_validate(*_args(cfg, costs, 60), "--json").output)
    assert out["memory_workload"].startswith("worst case")
    assert any(n.startswith("[23] forecast for the worst case: 1 rows of") for n in out["notes"]), out["notes"]


def test_plan_forecasts_the_datas_largest_micro_batch_where_it_has_the_counts(tmp_path):
    from mimo_sft.plan import PlanOptions, build_plan

    cfg = _cfg(tiny_checkpoint_dir(), demo_dataset_dir(), tmp_path / "costs", "--seq-length", "256")
    plan = build_plan(cfg, PlanOptions(steps=2))
    assert plan["memory_report"]["workload"].startswith("this data: heaviest of 2 planned micro-batches")
    counts = _write_costs(cfg)
    plan = build_plan(cfg, PlanOptions(steps=2))
    assert plan["memory_report"]["workload"].startswith(f"this data: the largest micro-batch its {counts.rows} rows")


def test_encoder_balance_bounds_a_tower_that_encodes_images_of_other_rows(tiny_counts):
    """--encoder-balance moves single images between towers, keeping each tower's patches within the heaviest
    rank's as read: any set of images within those patches, from any rows, stays within the slot bounds."""
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.testing.saved_bytes import image_segments, vision_block
    from mimo_sft.validate import check_config

    cfg, counts = tiny_counts
    cfg = load_config(["--hf-model", cfg.model.hf_model, "--dataset-path", cfg.data.dataset_path, "--cost-dir",
                       cfg.data.cost_dir, "--allow-random-init", "--seq-length", str(SEQ), "--max-pixels", "50176",
                       "--component", "language=dp=2", "--component", "images=dp=2", "--micro-batch-size", "4",
                       "--global-batch-size", "4", "--encoder-balance", "--reorder-mode", "index",
                       "--intra-microbatch-reorder", "--scalable-dp"])
    result = check_config(cfg, row_counts=None)
    assert result.ok, result.problems
    hf = read_hf_config(cfg.model.hf_model)
    plain = fd.data_workload(dataclasses.replace(cfg, reorder=dataclasses.replace(cfg.reorder, encoder_balance=False)),
                             result.layout, hf, counts)
    wl = fd.data_workload(cfg, result.layout, hf, counts)
    assert wl.image_patches == plain.image_patches and wl.window_slots >= plain.window_slots
    _, vcfg = vision_block(cfg.model.hf_model, dtype=torch.float32)
    images = [[int(x) for x in g] for s in counts.sources for g in s.grids]
    rng = random.Random(3)
    for _ in range(300):
        pick, patches = [], 0
        for g in rng.sample(images, len(images)):
            if patches + g[0] * g[1] * g[2] <= wl.image_patches:
                pick.append(g)
                patches += g[0] * g[1] * g[2]
        windows, whole = image_segments(vcfg, pick)
        assert _real_slots(windows) <= wl.window_slots and _real_slots(whole) <= wl.image_slots, pick
