"""Every validate check: a good layout passes; each bad input is refused with its own message."""

import json

import pytest

from mimo_sft.config.checks.registry import CHECKS
from mimo_sft.validate import check_config, require_valid
from mimo_sft.config.loader import load_config
from mimo_sft.errors import UserError

GOOD = ["--component", "language=tp=1,pp=1,dp=2,rank_offset=0", "--component", "images=tp=1,dp=2,rank_offset=2",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--scalable-dp", "--intra-microbatch-reorder"]


def problems(args, **kw):
    cfg = load_config(args)
    res = check_config(cfg, **kw)
    return [str(p) for p in res.problems], res


def test_good_layout_passes():
    probs, res = problems(GOOD)
    assert probs == [] and res.ok and res.layout.canonical_grid == 2


@pytest.mark.parametrize("layout", [("language=tp=2,dp=1", "images=dp=2"), ("language=dp=2", "images=tp=2,dp=1")])
def test_colocated_fan_in_and_fan_out_pass_without_an_image_size_condition(layout):
    """The padded bridge takes any image-token counts: no problem, and no note asking for fixed sizes."""
    probs, res = problems(comp(*layout) + ["--micro-batch-size", "4", "--global-batch-size", "8"])
    assert probs == [] and res.ok
    assert not any("image" in str(n) and "token" in str(n) for n in res.notes), res.notes


@pytest.mark.parametrize("layout", [("language=dp=2", "images=dp=2"), ("language=tp=2,dp=2", "images=dp=4"),
                                    ("language=dp=4", "images=tp=2,dp=2")])
def test_colocated_layouts_balance_by_index(layout):
    """Check 11 lets colocated equal DP, fan-in and fan-out reorder (by index, the default mode)."""
    probs, res = problems(comp(*layout) + ["--micro-batch-size", "8", "--global-batch-size", "8", "--scalable-dp",
                                           "--intra-microbatch-reorder"])
    assert probs == [] and res.ok and res.layout.colocated


def test_checks_are_numbered_uniquely():
    numbers = [n for n, _, _ in CHECKS]
    assert numbers == sorted(set(numbers))


def comp(*specs):
    out = []
    for s in specs:
        out += ["--component", s]
    return out


CASES = [
    ("non-positive dp", comp("language=dp=0", "images=dp=1,rank_offset=0"), "[01] language.dp=0 must be >= 1"),
    ("non-positive mbs", GOOD + ["--micro-batch-size", "0"], "--micro-batch-size=0 must be >= 1"),
    ("non-positive seq", GOOD + ["--seq-length", "0"], "--seq-length=0 must be >= 1"),
    ("overlap", comp("language=dp=2", "images=dp=2,rank_offset=1"), "overlap at rank 1"),
    ("gap", comp("language=dp=2", "images=dp=2,rank_offset=3"), "ranks 2 belong to no module"),
    ("world size", GOOD + ["--world-size", "8"], "world size 8 does not match the 4 ranks"),
    ("no language", comp("images=dp=2"), "no 'language' module"),
    ("wrong modality", comp("language=dp=2", "audio=dp=2,rank_offset=2"), "module 'audio' is not a modality"),
    ("tp power of two", comp("language=tp=3,dp=1", "images=dp=1,rank_offset=3"), "language.tp=3 is not a power of two"),
    ("dp divisibility", comp("language=dp=3", "images=dp=2,rank_offset=3") + ["--micro-batch-size", "6",
                                                                            "--global-batch-size", "6"],
     "DP sizes 2 and 3 do not divide one another"),
    ("mbs canonical", GOOD + ["--micro-batch-size", "3", "--global-batch-size", "6"], "not divisible by the canonical grid 2"),
    ("gbs multiple", GOOD + ["--global-batch-size", "6"], "--global-batch-size=6 is not a multiple of --micro-batch-size=4"),
    ("encoder pp", comp("language=dp=2", "images=dp=2,pp=2,rank_offset=2"), "images.pp=2: encoder pipeline parallelism"),
    ("encoder tp", comp("language=dp=2", "images=dp=2,tp=2,rank_offset=2"), "images.tp=2"),
    ("encoder dp > language dp", comp("language=dp=1", "images=dp=2,rank_offset=1"), "images.dp=2 > language.dp=1"),
    ("reorder without scalable", [a for a in GOOD if a != "--scalable-dp"], "needs --scalable-dp"),
    ("reorder without padding", GOOD + ["--no-pad-to-seq-length"], "needs --pad-to-seq-length"),
    ("scalable drop_last", GOOD + ["--no-drop-last"], "--scalable-dp needs --drop-last"),
    ("etp with scalable", comp("language=tp=2,etp=2,dp=2", "images=dp=2,rank_offset=4") + GOOD[4:],
     "language.etp=2: expert tensor parallelism > 1 is rejected with --scalable-dp"),
    ("negative weight", GOOD + ["--reorder-language-cost-weight", "-1"], "must be >= 0"),
    ("both weights zero", GOOD + ["--reorder-encoder-cost-weight", "0"], "both reorder cost weights are 0"),
    ("window", GOOD + ["--reorder-window-size", "0"], "--reorder-window-size=0 must be >= 1"),
    ("colocated pp", comp("language=dp=2,pp=2", "images=dp=4") + ["--micro-batch-size", "4"],
     "ColocatedBridgeCommunicator needs pp=1"),
    ("colocated reorder by exchange", comp("language=dp=2", "images=dp=2") + GOOD[4:] + ["--reorder-mode", "exchange"],
     "--reorder-mode exchange with --intra-microbatch-reorder on a colocated layout is not supported"),
    ("colocated reorder dp", comp("language=tp=2,dp=3", "images=tp=3,dp=2") + GOOD[4:] + ["--micro-batch-size", "6",
                                                                                          "--global-batch-size", "6"],
     "--intra-microbatch-reorder on a colocated layout needs DP sizes that divide one another (got 2 and 3)"),
    ("colocated reorder weights", comp("language=dp=2", "images=dp=2") + GOOD[4:] + ["--reorder-encoder-cost-weight",
                                                                                    "0"],
     "both reorder cost weights are 0; set --reorder-encoder-cost-weight"),
    ("cp with local attention", comp("language=dp=1,cp=2", "images=dp=1,rank_offset=2") + [
        "--attention-backend", "local", "--no-in-batch-packing"], "--attention-backend local with language.cp=2"),
    ("cp seq length", comp("language=dp=1,cp=4", "images=dp=1,rank_offset=4") + ["--seq-length", "6"],
     "--seq-length=6 is shorter than 2*cp=8"),
    ("colocated encoder cp", comp("language=cp=2,dp=1", "images=dp=1,cp=2"), "images.cp=2: encoder context"),
    ("encoder balance non-colocated", GOOD + ["--encoder-balance"], "--encoder-balance needs a colocated layout"),
    ("encoder balance fan-in", comp("language=tp=2,dp=1", "images=dp=2") + ["--encoder-balance"],
     "--encoder-balance on a colocated layout needs equal DP sizes (got [1, 2]"),
]


@pytest.mark.parametrize("name,args,needle", CASES, ids=[c[0] for c in CASES])
def test_each_bad_input_is_refused(name, args, needle):
    probs, res = problems(args)
    assert not res.ok
    assert any(needle in p for p in probs), probs
    assert all("\n" not in p for p in probs)


def test_overlap_allowed_under_single_connection(monkeypatch):
    # the overlap thread exchanges host tensors over gloo, so one CUDA hardware queue cannot deadlock it
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    probs, _ = problems(GOOD)
    assert probs == []


def test_load_with_pretrained_refused(tmp_path):
    probs, _ = problems(GOOD + ["--load-checkpoint", str(tmp_path), "--pretrained-checkpoint", str(tmp_path)])
    assert any("exclusive" in p for p in probs)


def test_all_problems_reported_at_once():
    probs, _ = problems(comp("language=tp=3,dp=2", "images=dp=4,pp=2,rank_offset=1") +
                        ["--micro-batch-size", "6", "--global-batch-size", "8", "--intra-microbatch-reorder"])
    assert len({p[:4] for p in probs}) >= 5


def test_language_cp_is_accepted_colocated_and_not():
    for layout in (comp("language=cp=2,dp=1", "images=dp=2"), comp("language=cp=2,dp=1", "images=dp=1,rank_offset=2"),
                   comp("language=tp=2,cp=2,dp=1", "images=dp=4")):
        probs, res = problems(layout)
        assert res.ok and not [p for p in probs if "cp" in p], probs


def test_cp_must_divide_the_heads_per_tp_rank(tmp_path):
    """Qwen2.5-VL-7B's 28 query heads at tp 2 leave 14 per rank: cp 2 or 7, never 4 (the issue's example)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "text_config": {"num_attention_heads": 28, "num_key_value_heads": 4,
                                                    "num_hidden_layers": 28}}))
    bad, _ = problems(comp("language=tp=2,cp=4,dp=1", "images=dp=8") + ["--hf-model", str(tmp_path)])
    assert any("language.cp=4 does not divide the 14 attention heads per tensor-parallel rank (28 / tp 2); "
               "choose cp from [2, 7, 14]" in p for p in bad), bad
    good, _ = problems(comp("language=tp=2,cp=2,dp=1", "images=dp=4") + ["--hf-model", str(tmp_path)])
    assert not [p for p in good if "does not divide" in p], good  # 4 KV heads / tp 2 = 2: cp 2 divides them too
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "text_config": {"num_attention_heads": 8, "num_key_value_heads": 2,
                                                 "num_hidden_layers": 4, "linear_num_key_heads": 2,
                                                 "linear_num_value_heads": 4}}))
    gdn, _ = problems(comp("language=cp=4,dp=1", "images=dp=4") + ["--hf-model", str(tmp_path)])
    assert any("language.cp=4 does not divide the 2 Gated DeltaNet key heads per tensor-parallel rank" in p
               for p in gdn), gdn


def test_model_divisibility_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "text_config": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 3}}))
    probs, _ = problems(comp("language=tp=4,dp=1", "images=dp=1,rank_offset=4") + ["--hf-model", str(tmp_path)])
    assert any("does not divide the model's 2 key/value heads" in p for p in probs)
    probs, _ = problems(comp("language=pp=2,dp=1", "images=dp=1,rank_offset=2") + ["--hf-model", str(tmp_path)])
    assert any("does not divide the model's 3 layers" in p for p in probs)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    probs, _ = problems(GOOD + ["--hf-model", str(tmp_path)])
    assert any("'llava' is not supported; supported model types: qwen2_5_vl, qwen3_vl" in p for p in probs)


def test_finetune_requires_model_and_data():
    cfg = load_config(GOOD)
    with pytest.raises(UserError) as e:
        require_valid(cfg, for_run=True)
    assert "--hf-model" in str(e.value) and "--dataset-path" in str(e.value)
    assert check_config(cfg).ok  # validate only notes them


def test_missing_dataset_path_is_refused_but_hub_names_pass(tmp_path):
    probs, _ = problems(GOOD + ["--dataset-path", str(tmp_path / "nope.parquet")])
    assert any("nope.parquet: not found" in p for p in probs)
    probs, _ = problems(GOOD + ["--dataset-path", "someorg/some-dataset"])
    assert not any("not found" in p for p in probs)


def test_packing_needs_the_sdpa_core_and_composes_with_everything_else():
    probs, _ = problems(GOOD + ["--in-batch-packing", "--attention-backend", "local"])
    assert probs == ["[19] --in-batch-packing with --attention-backend local: megatron's local core attention cannot "
                     "keep packed samples apart; use --attention-backend auto (the default), or --no-in-batch-packing to compute "
                     "padded rows"]
    for layout in (GOOD, comp("language=tp=2,dp=1", "images=dp=2") + ["--micro-batch-size", "4", "--global-batch-size", "8"],
                   comp("language=pp=2,dp=1", "images=dp=1,rank_offset=2") + ["--micro-batch-size", "4", "--global-batch-size", "8"]):
        probs, _ = problems(layout + ["--in-batch-packing"])
        assert probs == [], probs


def test_data_scale_settings_are_check_25():
    probs, res = problems(GOOD + ["--max-bad-samples", "-1", "--num-workers", "-2"])
    assert probs == ["[25] --num-workers=-2 must be >= 0, or -1 to pick from the CPUs of each rank",
                     "[25] --max-bad-samples=-1 must be >= 0 (0: stop at the first bad sample)"]
    assert not any(n.check == 25 for n in res.notes)  # index mode (the default) moves no bytes: nothing to note
    probs, res = problems(GOOD + ["--reorder-mode", "exchange"])
    assert probs == [] and [n.check for n in res.notes if "exchange" in n.message] == [25]
    probs, _ = problems(GOOD + ["--num-workers", "-1", "--max-bad-samples", "0"])
    assert probs == []
