"""LoRA without processes: validate refuses bad LoRA flags (check 20), YAML lists, which checkpoints a
LoRA run may start from, what LoRA freezes, and export's refusals. The tensor-parallel, resume and
export exactness tests are end to end (tests/test_lora_e2e.py)."""

import pytest
import torch
from typer.testing import CliRunner

from mimo_sft.cli import app
from mimo_sft.validate import check_config
from mimo_sft.config.loader import config_from_dict, load_config
from mimo_sft.errors import UserError

GOOD = ["--component", "language=tp=2,dp=1", "--component", "images=dp=2", "--micro-batch-size", "4",
        "--global-batch-size", "8"]


def lora_problems(args):
    return [str(p) for p in check_config(load_config([*GOOD, *args])).problems]


def test_good_lora_flags_pass():
    assert lora_problems(["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
                          "--lora-target-modules", "linear_qkv,linear_fc2,vision_attn,merger"]) == []


@pytest.mark.parametrize("args, expected", [
    (["--lora-target-modules", "linear_qkv,q_proj", "--lora-rank", "4"],
     "[20] --lora-target-modules: unknown 'q_proj'; choose from linear_qkv, linear_proj, linear_fc1, linear_fc2, "
     "vision_attn, vision_mlp, merger"),
    (["--lora-alpha", "16"], "[20] --lora-alpha=16.0 is set but LoRA is off; give --lora-rank R"),
    (["--lora-rank", "-2"], "[20] --lora-rank=-2: must be 0 (LoRA off) or a positive rank"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "[20] --lora-alpha=0.0: must be positive"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "[20] --lora-dropout=1.0: must be in [0, 1)"),
    (["--lora-rank", "4", "--lora-target-modules", ","], "[20] --lora-target-modules is empty"),
])
def test_bad_lora_flags_are_refused(args, expected):
    probs = lora_problems(args)
    assert len(probs) == 1 and probs[0].startswith(expected), probs


def test_lora_uses_the_plain_optimizer_with_a_note():
    """The distributed optimizer is the default; a LoRA run quietly uses the plain one and says so."""
    from mimo_sft.config.lora import distributed_optimizer_in_use

    for args in ([], ["--use-distributed-optimizer"]):
        cfg = load_config([*GOOD, "--lora-rank", "4", *args])
        res = check_config(cfg)
        assert res.ok and not distributed_optimizer_in_use(cfg)
        assert any(n.check == 20 and "plain (unsharded) optimizer" in n.message for n in res.notes), res.notes
    full = load_config(GOOD)
    assert full.optimizer.use_distributed_optimizer and distributed_optimizer_in_use(full)
    assert not distributed_optimizer_in_use(load_config([*GOOD, "--no-use-distributed-optimizer"]))
    assert not any(n.check == 20 for n in check_config(full).notes)


def test_all_lora_problems_at_once_through_validate():
    res = CliRunner().invoke(app, ["validate", "--quiet", *GOOD, "--lora-rank", "4", "--lora-alpha", "-1",
                                   "--lora-dropout", "2", "--lora-target-modules", "linear_qkv,bogus"])
    assert res.exit_code == 2, res.output
    for text in ("--lora-alpha=-1.0", "--lora-dropout=2.0", "unknown 'bogus'"):
        assert text in res.output, res.output


def test_yaml_takes_a_list_of_targets():
    cfg = config_from_dict({"model": {"lora_rank": 8, "lora_target_modules": ["linear_qkv", "merger"]}})
    assert cfg.model.lora_target_modules == "linear_qkv,merger"
    from mimo_sft.config.lora import LoraSpec

    spec = LoraSpec.from_model_config(cfg.model)
    assert spec.targets == ("linear_qkv", "merger") and spec.alpha == 8.0 and spec.scaling == 1.0


def test_which_checkpoints_a_run_may_start_from():
    from mimo_sft.train.checkpoint.lora import check_lora_compatible

    def model(**kw):
        return load_config([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]).model

    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["linear_qkv"], "freeze_vision": False,
            "freeze_projector": False, "freeze_language": False}
    meta = {"lora": lora, "hf_model": "/base"}
    same = model(lora_rank=4, lora_alpha=8, lora_target_modules="linear_qkv")
    check_lora_compatible(meta, same, path="ck", resume=True)
    check_lora_compatible({}, same, path="ck", resume=False)  # LoRA on a full FT
    with pytest.raises(UserError, match="--lora-rank 0 but the checkpoint ck is a LoRA checkpoint .*drop --lora-rank "
                                        ".*mimo-sft export --checkpoint ck"):
        check_lora_compatible(meta, model(), path="ck", resume=False)
    with pytest.raises(UserError, match="^--lora-rank 8 differs from the checkpoint's 4 .*drop --lora-rank"):
        check_lora_compatible(meta, model(lora_rank=8, lora_target_modules="linear_qkv"), path="ck", resume=True)
    with pytest.raises(UserError, match="full fine-tuning checkpoint; resume it without --lora-rank"):
        check_lora_compatible({}, same, path="ck", resume=True)
    with pytest.raises(UserError, match="--freeze-vision=True differs from the checkpoint's --freeze-vision=False"):
        check_lora_compatible(meta, model(lora_rank=4, lora_alpha=8, lora_target_modules="linear_qkv",
                                          freeze_vision="true"), path="ck", resume=True)


def _tiny():
    from train_helpers import tiny_model

    return tiny_model()


def test_lora_freezes_the_base_and_adapts_the_targets(tmp_path):
    """Language base frozen, vision tower trainable unless a vision target adapts it; B starts at 0,
    A is the same full tensor whatever the slicing; merging restores the layer classes."""
    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.lora import apply_lora, lora_modules, merge_lora

    model, info = build_single_process_model(_tiny(), prefer="cpu")
    spec = LoraSpec(4, 8.0, 0.0, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    qkv = model.language_model.decoder.layers[0].self_attention.linear_qkv
    cls = type(qkv)
    apply_lora(model, spec, seed=3)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or n.startswith("modality_submodules.") for n in trainable)
    assert any(n.startswith("modality_submodules.") and "lora" not in n for n in trainable)  # vision still trains
    assert len(list(lora_modules(model))) == 2 * 4 and torch.count_nonzero(qkv.lora_b) == 0
    again, _ = build_single_process_model(_tiny(), prefer="cpu")
    apply_lora(again, spec, seed=3)
    assert torch.equal(again.language_model.decoder.layers[0].self_attention.linear_qkv.lora_a, qkv.lora_a)
    w = qkv.weight.detach().clone()
    with torch.no_grad():
        qkv.lora_b.normal_()
    expected = w + 2.0 * qkv.lora_b.detach() @ qkv.lora_a.detach()
    assert merge_lora(model) == 8 and type(qkv) is cls and not hasattr(qkv, "lora_a")
    assert torch.allclose(qkv.weight, expected, atol=1e-6)
    vision, _ = build_single_process_model(_tiny(), prefer="cpu")
    apply_lora(vision, LoraSpec(2, 2.0, 0.0, ("vision_mlp", "merger")), seed=0)
    enc = vision.modality_submodules["images"].encoders[info.encoder_name]
    assert {n for n, p in enc.named_parameters() if p.requires_grad} == {
        f"{m}.lora_{x}" for m in ("blocks.0.mlp.gate_proj", "blocks.0.mlp.up_proj", "blocks.0.mlp.down_proj",
                                  "blocks.1.mlp.gate_proj", "blocks.1.mlp.up_proj", "blocks.1.mlp.down_proj",
                                  "merger.mlp.0", "merger.mlp.2") for x in "ab"}


@pytest.mark.parametrize("targets, frozen, saved", [
    # the default recipe: language adapters, the whole vision tower (with its merger) trains
    (("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), {}, ["model.visual"]),
    # merger adapters: its base is frozen, so the tower's trained parts are saved around it
    (("linear_qkv", "merger"), {}, ["model.visual.patch_embed", "model.visual.blocks.0", "model.visual.blocks.1"]),
    # tower frozen, projector trains
    (("linear_fc2",), {"freeze_vision": True}, ["model.visual.merger"]),
])
def test_peft_adapter_carries_trained_vision_modules(tmp_path, targets, frozen, saved):
    """``export --adapter-only`` of a LoRA run whose vision tower or projector also trained: the trained
    modules go in as PEFT ``modules_to_save``, and ``PeftModel.from_pretrained`` on the base model gives
    the training model's logits, as the merged export does (each within 1e-5)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.export import export_model
    from mimo_sft.model.lora import apply_lora, merge_lora
    from mimo_sft.model.lora_export import write_peft_adapter

    model, info = build_single_process_model(_tiny(), prefer="cpu", model_cfg=ModelConfig(**frozen))
    spec = LoraSpec(2, 4.0, 0.0, targets)
    apply_lora(model, spec, seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # "training": every trainable tensor moves (B away from 0, trained bases)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    written = write_peft_adapter(model, info, spec, _tiny(), str(tmp_path / "adapter"))
    assert written["modules_to_save"] == saved

    def hf(path):
        return AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()

    base = hf(_tiny())
    batch = random_batch(base.config, seed=3, images_per_sample=((1, 2),))
    pos = hf_position_ids(base, batch)
    model.eval()
    ours = mimo_forward(model, info, batch, pos)
    base_logits, _ = hf_forward(base, batch)
    peft_logits, _ = hf_forward(PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval(), batch)
    merge_lora(model)
    export_model(model, _tiny(), str(tmp_path / "merged"))
    merged_logits, _ = hf_forward(hf(str(tmp_path / "merged")), batch)
    mask = batch["attention_mask"]
    assert compare(peft_logits, ours, mask) < 1e-5
    assert compare(merged_logits, ours, mask) < 1e-5
    assert compare(base_logits, ours, mask) > 1e-3
