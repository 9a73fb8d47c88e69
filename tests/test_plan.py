"""`mimo-sft plan`: its figures are the training loop's figures, and user mistakes are one line.

The planner is only useful if what it prints is what training will log. Three levels check that:

* pure: ``simulate.trace`` gives, per micro-batch, exactly the vision-load statistics that
  ``planning.window_plan_info`` (what the reorder buffer logs) gives for the same costs;
* single process: the planner's per-sample numbers (metadata only, no pixels) and sample order
  equal what the real micro-batch iterators hand each language rank (``input_ids`` patches,
  ``attention_mask`` tokens, ``sample_ids``), including truncation replacement;
* end to end (distributed): a real 4-process fine-tune's ``metrics.jsonl``
  ``vision_load_max_over_mean_before/_after`` per step equals the planner's per-step values.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from typer.testing import CliRunner

from mimo_sft.cli import app
from mimo_sft.errors import UserError
from mimo_sft.plan import split_plan_args, simulate
from train_helpers import demo_data, metrics, new_dir, tiny_model, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
runner = CliRunner()


def _args(*extra, data=None):
    # batch sizes pinned here so the expectations below do not move with configs/demo.yaml
    return ["plan", "--config", DEMO, "--hf-model", tiny_model(), "--dataset-path", data or demo_data(),
            "--micro-batch-size", "4", "--global-batch-size", "8", *extra]


def _one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert "Traceback" not in res.output and len(err.splitlines()) == 1, res.output
    assert err.startswith("error: ")
    return err


# ---------------------------------------------------------------------------------- pure parts

def test_own_flags_are_stripped_and_parsed():
    opts, rest = split_plan_args(["--config", "c.yaml", "--steps", "7", "--json", "--out=o", "--compare-window",
                                  "1,2,4", "--compare-cost-weights", "0,0.5", "--seq-length", "64"])
    assert rest == ["--config", "c.yaml", "--seq-length", "64"]
    assert (opts.steps, opts.out, opts.as_json, opts.windows, opts.language_weights) == (7, "o", True, [1, 2, 4], [0.0, 0.5])
    for bad in (["--steps", "0"], ["--steps", "x"], ["--compare-window", "1,a"], ["--compare-window", "0"],
                ["--compare-cost-weights", "-1"], ["--out"]):
        with pytest.raises(UserError):
            split_plan_args(bad)


@pytest.mark.parametrize("lang_dp,img_dp,mbs,lang_w,window", [(2, 2, 4, 0.0, 1), (4, 2, 8, 0.5, 2), (2, 1, 6, 1.0, 3),
                                                            (1, 1, 4, 0.0, 1)])
def test_trace_is_what_the_exchange_logs(lang_dp, img_dp, mbs, lang_w, window):
    """The buffer's per-micro-batch stats (planning.window_plan_info) for the same global costs."""
    from mimo_sft.data.reorder.window_plan import window_plan_info
    from mimo_sft.parallel.layout import lcm

    rng = random.Random(lang_dp * 100 + mbs)
    grid = lcm([lang_dp, img_dp])
    mbl = [simulate.MicroBatchLoad(list(range(mbs)), [float(rng.choice([0, 16, 64, 256, 1024])) for _ in range(mbs)],
                                   [float(rng.randint(20, 300)) for _ in range(mbs)]) for _ in range(7)]
    tr = simulate.trace(mbl, n_groups=grid, dp_sizes={"images": img_dp, "language": lang_dp}, encoder_cost_weight=1.0,
                        language_cost_weight=lang_w, window_size=window)
    costs = [simulate.costs_of(m, 1.0, lang_w) for m in mbl]
    infos = window_plan_info(costs, [m.patches for m in mbl], n_groups=grid, dp_size=lang_dp,
                             stats_dp_sizes={"vision": img_dp, "tok": lang_dp})
    infos_tok = window_plan_info(costs, [m.tokens for m in mbl], n_groups=grid, dp_size=lang_dp,
                                 stats_dp_sizes={"tok": lang_dp})
    s_img, s_lang = simulate.per_micro_batch(tr["images"]), simulate.per_micro_batch(tr["language"])
    for k, (info, itok) in enumerate(zip(infos, infos_tok)):
        assert tr["images"].before[k] == info["vision_load_before"]
        assert tr["images"].after[k] == info["vision_load_after"]
        assert s_img["max_over_mean_after"][k] == info["vision_load_max_over_mean_after"]
        assert s_img["spread_before"][k] == info["vision_load_max_minus_min_before"]
        assert tr["language"].after[k] == itok["tok_load_after"]
        assert s_lang["max_over_mean_before"][k] == itok["tok_load_max_over_mean_before"]
    if lang_w == 0.0 and grid > 1:  # balancing on patches alone never makes the heaviest encoder rank heavier
        assert all(a <= b for a, b in zip(s_img["max_after"], s_img["max_before"]))
        assert any(a < b for a, b in zip(s_img["max_after"], s_img["max_before"]))


def test_summary_and_training_steps_arithmetic():
    tr = simulate.ModuleTrace(2, before=[[30.0, 10.0], [0.0, 0.0], [20.0, 20.0]], after=[[20.0, 20.0], [0.0, 0.0], [20.0, 20.0]])
    s = simulate.summarize(tr)
    assert s["max_over_mean_before"] == pytest.approx((1.5 + 1.0 + 1.0) / 3)  # empty micro-batch counts as 1.0, like load_spread
    assert s["spread_before"] == pytest.approx(20 / 3) and s["spread_after"] == 0
    assert s["wait_share_before"] == pytest.approx((1 - 20 / 30) / 3) and s["wait_share_after"] == 0
    steps = simulate.training_steps(tr, 2)
    assert steps == [{"step": 1, "max_over_mean_before": 1.25, "max_over_mean_after": 1.0}]  # the partial step is left out


def test_language_positions_padded_vs_packed():
    from mimo_sft.plan.positions import language_positions

    tokens = [[10.0, 50.0, 20.0, 40.0], [30.0, 30.0, 0.0, 60.0]]
    pos = language_positions(tokens, [[1, 0, 3, 2], None], 2, seq_length=64, pad_to_seq_length=True)
    assert pos["per_micro_batch"]["padded"] == [[128, 128], [128, 128]]
    assert pos["per_micro_batch"]["packed"] == [[60.0, 60.0], [60.0, 60.0]]
    assert pos["padded_per_rank"] == 128 and pos["packed_per_rank"] == 60
    assert pos["padding_fraction"] == pytest.approx(1 - 240 / 512)
    # without --pad-to-seq-length each rank pads to its own longest sample
    loose = language_positions(tokens, None, 2, seq_length=64, pad_to_seq_length=False)
    assert loose["per_micro_batch"]["padded"] == [[100, 80], [60, 120]]
    assert loose["max_over_mean_packed"] == 1.0  # [60, 60] and [60, 60] real tokens per rank
    assert loose["max_over_mean_padded"] == pytest.approx((100 / 90 + 120 / 90) / 2)


def test_plan_reports_packed_and_padded_positions():
    res = runner.invoke(app, _args("--steps", "6", "--json", "--in-batch-packing", "--seq-length", "256"))
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    pos = plan["language_positions"]
    assert pos["in_batch_packing"] is True
    local = plan["micro_batch_size"] // plan["layout"]["language"]["dp"]
    assert pos["padded_per_rank"] == local * 256
    # packed positions are the language ranks' real tokens: the module's mean load
    assert pos["packed_per_rank"] == pytest.approx(plan["modules"]["language"]["mean_load"])
    assert 0 < pos["padding_fraction"] == pytest.approx(1 - pos["packed_per_rank"] / pos["padded_per_rank"])
    table = runner.invoke(app, _args("--steps", "4", "--seq-length", "256"))
    assert "padding" in table.output and "--in-batch-packing is ON in config" in table.output  # configs/demo.yaml packs


# ------------------------------------------------------------------ single process: real data path

def _long_multi_image_data() -> str:
    """Demo-like data plus 3-image pages that do not fit in --seq-length 128 (training replaces them)."""
    import datasets

    from mimo_sft.testing.demo_data import image_png

    folder = new_dir("plan_long_multi")
    rng = random.Random(3)
    rows = []
    for i in range(40):
        n_img = 3 if i % 5 == 2 else (0 if i % 7 == 6 else 1)
        big = n_img == 3 or i % 3 == 0
        imgs = [{"bytes": image_png(rng, *(rng.randint(300, 400), rng.randint(400, 500)) if big
                                 else (rng.randint(56, 90), rng.randint(90, 160)), "red", i), "path": None}
                for _ in range(n_img)]
        text = "Describe. " * rng.randint(1, 12)
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "text": None}] * n_img + [{"type": "text", "text": text}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": f"Answer {i}."}]}],
                     "images": imgs})
    feats = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"),
                                   "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")})}),
        "images": datasets.List(datasets.Image())})
    datasets.Dataset.from_list(rows, features=feats).to_parquet(os.path.join(folder, "train.parquet"))
    return folder


def test_planner_numbers_are_the_iterators_numbers():
    """Language ranks' real micro-batches (no pixels) give the planner's sample ids, costs and stats."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.data.loader import build_microbatch_iterator, build_preprocessor
    from mimo_sft.data.reorder import make_cost_fn, make_patch_count_fn
    from mimo_sft.data.reorder.window_plan import window_plan_info
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.plan import PlanOptions, build_plan

    data = _long_multi_image_data()
    cfg = load_config(["--component", "language=tp=1,dp=4,rank_offset=0", "--component", "images=dp=2,rank_offset=4",
                       "--scalable-dp", "--hf-model", tiny_model(), "--dataset-path", data, "--seq-length", "128",
                       "--micro-batch-size", "8", "--global-batch-size", "16", "--dataloader-type", "cyclic",
                       "--reorder-language-cost-weight", "0.5", "--seed", "7"])
    steps = 6
    plan = build_plan(cfg, PlanOptions(steps=steps))
    assert plan["data"]["replaced_too_long"] > 0  # the replacement path is exercised
    source, pre = load_sft_dataset(cfg.data), build_preprocessor(cfg.data, cfg.model.hf_model)
    its = [build_microbatch_iterator(cfg.data, model_dir=cfg.model.hf_model, micro_batch_size=8, canonical_grid=4,
                                     dp_size=4, dp_rank=r, need_pixels=False, seed=7, num_workers=0, source=source,
                                     preprocessor=pre) for r in range(4)]
    cost_fn = make_cost_fn(encoder_cost_weight=1.0, language_cost_weight=0.5, image_token_id=pre.image_token_id,
                           merge_size=pre.merge_size)
    patch_fn = make_patch_count_fn(image_token_id=pre.image_token_id, merge_size=pre.merge_size)
    img, lang = plan["modules"]["images"]["per_micro_batch"], plan["modules"]["language"]["per_micro_batch"]
    for k in range(steps):
        shards = [next(it) for it in its]
        assert [int(i) for b in shards for i in b["sample_ids"]] == plan["sample_ids"][k]
        costs = [c for b in shards for c in cost_fn(b)]
        loads = [c for b in shards for c in patch_fn(b)]
        tokens = [float(t) for b in shards for t in b["attention_mask"].sum(1).tolist()]
        (info,) = window_plan_info([costs], [loads], n_groups=4, dp_size=4, stats_dp_sizes={"vision": 2})
        (tinfo,) = window_plan_info([costs], [tokens], n_groups=4, dp_size=4, stats_dp_sizes={"lang": 4})
        assert img["max_over_mean_before"][k] == info["vision_load_max_over_mean_before"]
        assert img["max_over_mean_after"][k] == info["vision_load_max_over_mean_after"]
        assert img["spread_after"][k] == info["vision_load_max_minus_min_after"]
        assert lang["max_after"][k] == max(tinfo["lang_load_after"])
        assert lang["min_before"][k] == min(tinfo["lang_load_before"])


def test_a_mixtures_plan_follows_the_weighted_interleave():
    """With two sources the planned sample ids are the ones the run's iterators read (the mixture's weighted
    interleave, per-source epochs and same-source replacements), not the joined dataset's order."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.data.loader import build_microbatch_iterator, build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset
    from mimo_sft.plan import PlanOptions, build_plan

    data = _long_multi_image_data()
    cfg = load_config(["--component", "language=tp=1,dp=2,rank_offset=0", "--component", "images=dp=2,rank_offset=2",
                       "--scalable-dp", "--hf-model", tiny_model(), "--dataset-path", data, "--dataset-path", demo_data(),
                       "--dataset-weights", "0.3,0.7", "--seq-length", "128", "--micro-batch-size", "8",
                       "--global-batch-size", "16", "--dataloader-type", "cyclic", "--seed", "7"])
    steps = 4
    plan = build_plan(cfg, PlanOptions(steps=steps))
    source, pre = load_sft_dataset(cfg.data), build_preprocessor(cfg.data, cfg.model.hf_model)
    its = [build_microbatch_iterator(cfg.data, model_dir=cfg.model.hf_model, micro_batch_size=8, canonical_grid=2,
                                     dp_size=2, dp_rank=r, need_pixels=False, seed=7, num_workers=0, source=source,
                                     preprocessor=pre) for r in range(2)]
    for k in range(steps):
        assert [int(i) for it in its for i in next(it)["sample_ids"]] == plan["sample_ids"][k]
    first = source.sizes[0]
    drawn = [i for ids in plan["sample_ids"] for i in ids]
    assert 0 < sum(i < first for i in drawn) < len(drawn)  # both sources drawn


# ------------------------------------------------------------------------------- CLI

def test_table_and_png(tmp_path):
    res = runner.invoke(app, _args("--steps", "12", "--out", str(tmp_path), "--compare-window", "1,2",
                                   "--compare-cost-weights", "0,0.5"))
    assert res.exit_code == 0, res.output
    for text in ("images", "language", "max/mean", "idle", "reorder ON in config", "window 2", "language weight 0.5",
                 "window size leaves the balance unchanged"):
        assert text in res.output, text
    png = tmp_path / "plan.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["steps"] == 12 and len(saved["modules"]["images"]["per_micro_batch"]["max_before"]) == 12


def test_json_and_reordering_off_still_shows_what_it_would_do():
    res = runner.invoke(app, _args("--steps", "10", "--json", "--no-intra-microbatch-reorder", "--compare-window", "1,4"))
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["steps"] == 10 and plan["reorder"]["enabled_in_config"] is False and "OFF" in plan["note"]
    # the mode training would use, and what each mode would move between ranks
    assert plan["reorder"]["mode"] == "index" and plan["reorder"]["bytes_per_micro_batch"]["index"] == 0
    assert plan["reorder"]["bytes_per_micro_batch"]["exchange"] > 0
    img = plan["modules"]["images"]
    for key in ("max_over_mean_before", "max_over_mean_after", "spread_before", "spread_after",
                "max_over_mean_p95_before", "wait_share_before", "wait_share_after"):
        assert isinstance(img[key], float), key
    assert img["max_over_mean_after"] < img["max_over_mean_before"] and img["spread_after"] < img["spread_before"]
    assert 1.0 <= img["max_over_mean_after"] and img["wait_share_after"] < img["wait_share_before"]
    assert set(plan["modules"]) == {"images", "language"} and len(plan["compare"]) == 2
    assert len(plan["train_steps"]["vision_load_max_over_mean"]) == 5  # 10 micro-batches, 2 per step
    assert [len(ids) for ids in plan["sample_ids"]] == [4] * 10
    res_off = runner.invoke(app, _args("--steps", "4", "--no-intra-microbatch-reorder"))
    assert "OFF in config" in res_off.output and "would do" in res_off.output


def test_no_images_is_one_line(tmp_path):
    path = tmp_path / "text.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                          {"role": "assistant", "content": f"{i + 1}."}], "images": []} for i in range(16)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    err = _one_line_error(runner.invoke(app, _args("--steps", "3", data=str(path))))
    assert "no images" in err


def test_unreadable_dataset_is_one_line(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"this is not parquet")
    assert "--dataset-path" in _one_line_error(runner.invoke(app, _args(data=str(bad))))
    assert "not found" in _one_line_error(runner.invoke(app, _args(data=str(tmp_path / "missing" / "x.parquet"))))


def test_invalid_layout_is_one_line():
    err = _one_line_error(runner.invoke(app, _args("--component", "language=tp=1,dp=2,rank_offset=0",
                                                   "--component", "images=dp=2,rank_offset=1")))
    assert err.startswith("error: invalid config: [05]") and "overlap" in err
    err = _one_line_error(runner.invoke(app, _args("--micro-batch-size", "3", "--global-batch-size", "6")))
    assert "canonical grid" in err
    assert "--steps" in _one_line_error(runner.invoke(app, _args("--steps", "-2")))
    assert "--reorder-mode exchange" in _one_line_error(runner.invoke(app, _args(
        "--component", "language=dp=2", "--component", "images=dp=2", "--reorder-mode", "exchange")))


def test_colocated_plan_shows_every_gpu_before_and_after():
    """Fan-in (language tp 2 x dp 2, images dp 4): the ``gpus`` rows are each GPU's load -- its vision
    slice's patches plus its language DP rank's tokens over tp -- as read (recomputed here from the
    planned samples' numbers and the read shards) and as the per-GPU plan lays the samples out."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.plan.build import build_plan
    from mimo_sft.plan.flags import PlanOptions
    from mimo_sft.plan.build import _valid_layout as validate_layout
    from mimo_sft.plan.inputs import load_micro_batches

    args = _args("--component", "language=tp=2,dp=2", "--component", "images=dp=4", "--micro-batch-size", "8",
                 "--global-batch-size", "16", "--reorder-language-cost-weight", "0.5")
    res = runner.invoke(app, [*args, "--steps", "6"])
    assert res.exit_code == 0, res.output
    assert "gpus" in res.output and "heaviest GPU" in res.output
    cfg = load_config(args[1:])
    plan = build_plan(cfg, PlanOptions(steps=6))
    mbs_list, _ = load_micro_batches(cfg, validate_layout(cfg), 6)
    gpus = plan["modules"]["gpus"]["per_micro_batch"]
    for k, mb in enumerate(mbs_list):
        vision = [sum(mb.patches[2 * r:2 * r + 2]) for r in range(4)]          # images dp 4: 2 samples each
        language = [0.5 * sum(mb.tokens[4 * d:4 * d + 4]) / 2 for d in range(2)]  # dp 2, over tp 2
        before = [vision[g] + language[g // 2] for g in range(4)]
        assert gpus["max_before"][k] == pytest.approx(max(before), rel=1e-12)
        assert gpus["max_after"][k] <= gpus["max_before"][k]
    assert plan["modules"]["gpus"]["max_over_mean_after"] < plan["modules"]["gpus"]["max_over_mean_before"]


# ------------------------------------------------------------------------------- end to end

@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_matches_a_real_fine_tunes_metrics():
    """4 gloo processes (language dp 2 on 0-1, images dp 2 on 2-3), 3 steps: the logged per-step
    vision-load spread before/after reordering equals the planner's, to float precision. The
    language weight and a --seq-length that truncates some text make the order depend on the
    token counts too, so a planner that got those wrong would disagree."""
    common = ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--micro-batch-size", "8",
              "--global-batch-size", "16", "--reorder-language-cost-weight", "0.5", "--seq-length", "100"]
    out = new_dir("plan_e2e")
    torchrun(4, ["--config", DEMO, *common, "--train-iters", "3", "--output-dir", out, "--no-tensorboard"])
    logged = metrics(out)
    res = runner.invoke(app, ["plan", "--config", DEMO, *common, "--steps", "6", "--json"])
    assert res.exit_code == 0, res.output
    planned = json.loads(res.output)["train_steps"]["vision_load_max_over_mean"]
    assert len(logged) == len(planned) == 3
    for row, p in zip(logged, planned):
        assert row["vision_load_max_over_mean_before"] == pytest.approx(p["max_over_mean_before"], rel=1e-12)
        assert row["vision_load_max_over_mean_after"] == pytest.approx(p["max_over_mean_after"], rel=1e-12)
    assert any(p["max_over_mean_after"] < p["max_over_mean_before"] for p in planned)
    # the comparison can fail: the vision-only cost or untruncated tokens give other per-step numbers
    other = [runner.invoke(app, ["plan", "--config", DEMO, *common, *extra, "--steps", "6", "--json"])
             for extra in (["--reorder-language-cost-weight", "0"], ["--seq-length", "256"])]
    for res_other in other:
        alt = json.loads(res_other.output)["train_steps"]["vision_load_max_over_mean"]
        assert [a["max_over_mean_after"] for a in alt] != [p["max_over_mean_after"] for p in planned]
