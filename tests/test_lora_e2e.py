"""LoRA end to end under torchrun (gloo, CPU): language tp 2 computes what tp 1 computes, resume is
bit-exact, the checkpoint holds only what trains, and both exports reproduce the training model's
logits in transformers and in peft.

Every LoRA target is on (language qkv/proj/fc1/fc2, vision attention and MLP, patch merger), so
the vision tower and projector are frozen and the adapters are all that trains. B starts at 0, so
step 1 gives A no gradient: steps 1 and 2 are compared (step 2's A gradients are non-zero).
"""

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from e2e_runs import GROUP_LORA, finetune
from train_helpers import checkpoint_tensors, demo_data, metrics, new_dir, tiny_model, torchrun

pytestmark = [pytest.mark.e2e, GROUP_LORA]

TARGETS = "linear_qkv,linear_proj,linear_fc1,linear_fc2,vision_attn,vision_mlp,merger"
BASE = ["--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2",
        "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--no-tensorboard", "--dataloader-type", "cyclic",
        "--seed", "7", "--no-in-batch-packing", "--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", TARGETS]


#: the exports as they were before they streamed: the whole LoRA model built in host memory with the
#: source's weights and the checkpoint loaded into it, then written as a PEFT folder (argv 3, when given)
#: and merged (every adapter folded in, ``merge_lora``) as a Hugging Face folder (argv 2)
IN_MEMORY_EXPORTS = """
import sys
from mimo_sft.model.export import EXPORT_DTYPES, export_model
from mimo_sft.model.lora import merge_lora
from mimo_sft.model.lora_export import build_lora_model, write_peft_adapter
from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint
from mimo_sft.train.checkpoint.save import load_model_weights
ck = resolve_checkpoint(sys.argv[1])
meta = read_meta(ck)
model, info, spec = build_lora_model(meta["hf_model"], meta["lora"])
load_model_weights(model, ck)
if len(sys.argv) > 3:
    write_peft_adapter(model, info, spec, meta["hf_model"], sys.argv[3])
merge_lora(model)
export_model(model, meta["hf_model"], sys.argv[2], dtype=EXPORT_DTYPES[meta.get("dtype", "fp32")][0])
"""


def _same_tensors(file_a, file_b) -> dict:
    from safetensors.torch import load_file

    x, y = load_file(file_a), load_file(file_b)
    assert set(x) == set(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x), \
        [k for k in x if k not in y or not torch.equal(x[k], y[k])][:5]
    return x


def assert_exports_equal_in_memory_ones(checkpoint, export_dir, adapter_dir=None):
    """The streamed merged export (one group at a time, base weights from the source folder) is bit for
    bit the whole-model merge; the PEFT folder (``adapter_dir``: the adapters and trained weights read
    onto a meta-device model) is the whole model's, tensors and config."""
    ref, ref_adapter = new_dir("lora_in_memory_merge"), new_dir("lora_in_memory_adapter")
    subprocess.run([sys.executable, "-c", IN_MEMORY_EXPORTS, checkpoint, ref, *([ref_adapter] if adapter_dir else [])],
                   check=True, capture_output=True)
    if adapter_dir:
        _same_tensors(adapter_dir + "/adapter_model.safetensors", ref_adapter + "/adapter_model.safetensors")
        assert json.load(open(adapter_dir + "/adapter_config.json")) == json.load(open(ref_adapter + "/adapter_config.json"))
    return _same_tensors(export_dir + "/model.safetensors", ref + "/model.safetensors")


def run(name, nproc, components, extra=(), iters=2):
    return finetune(name, nproc, [*BASE, "--train-iters", str(iters), "--save-grads", "{out}/grads", *extra],
                    components=components).out


@pytest.fixture(scope="module")
def reference():
    """1 rank, tp 1: 4 steps, checkpoints at steps 2 and 4."""
    return run("lora_ref", 1, ["language=dp=1", "images=dp=1"], ["--save-interval", "2"], iters=4)


def _grads(run_dir, step):
    return checkpoint_tensors(f"{run_dir}/grads/iter_{step:07d}")


def assert_matches_reference(ref, got_dir):
    for step in (1, 2):
        a, b = metrics(ref)[step - 1], metrics(got_dir)[step - 1]
        assert math.isclose(b["loss"], a["loss"], rel_tol=1e-5), (step, b["loss"], a["loss"])
        # replicated adapters counted once by megatron's grad norm (a double count changes it)
        assert math.isclose(b["grad_norm"], a["grad_norm"], rel_tol=1e-5), (step, b["grad_norm"], a["grad_norm"])
        ga, gb = _grads(ref, step), _grads(got_dir, step)
        assert set(ga) == set(gb) and ga and all(".lora_" in k for k in ga), sorted(ga)[:4]
        for k in ga:
            scale = ga[k].abs().max().item()
            diff = (ga[k].double() - gb[k].double()).abs().max().item()
            assert diff <= 1e-5 * scale + 1e-12, f"step {step} {k}: differs by {diff} (largest {scale})"
            if step == 1 and k.endswith("lora_a"):
                assert scale == 0.0, k  # B = 0: no gradient reaches A yet
            else:
                assert scale > 0.0, f"step {step} {k}: no gradient"


def test_language_tp2_colocated_packed_equals_tp1_padded(reference):
    """Also in-batch packing: the packed tp 2 run's adapters see the padded tp 1 run's gradients."""
    got = run("lora_tp2_co", 2, ["language=tp=2,dp=1", "images=dp=2"], ["--scalable-dp", "--in-batch-packing"])
    assert_matches_reference(reference, got)
    assert metrics(got)[0]["padding_fraction"] == 0.0 < metrics(reference)[0]["padding_fraction"]


def test_language_tp2_dp2_non_colocated_with_reordering_equals_tp1(reference):
    got = run("lora_tp2_nonco", 5, ["language=tp=2,dp=2", "images=dp=1,rank_offset=4"],
              ["--scalable-dp", "--intra-microbatch-reorder", "--reorder-language-cost-weight", "1"])
    assert_matches_reference(reference, got)


def test_colocated_fan_out_equals_tp1(reference):
    """language dp 2 fed by images tp 2 x dp 1 on the same ranks: the vision tower (and its adapters)
    replicated over the images TP group."""
    got = run("lora_fanout", 2, ["language=dp=2", "images=tp=2,dp=1"], ["--scalable-dp"])
    assert_matches_reference(reference, got)


def test_checkpoint_holds_adapters_and_resume_is_bit_exact(reference):
    ck = reference + "/checkpoints/iter_0000002"
    meta = json.load(open(ck + "/meta.json"))
    assert meta["hf_model"] == tiny_model()
    assert meta["lora"]["rank"] == 4 and meta["lora"]["targets"] == TARGETS.split(",")
    tensors = checkpoint_tensors(ck)
    # A and B of: 4 language targets (megatron stacks the layers: [layers, ...]), 2 vision blocks x 5, 2 merger linears
    assert len(tensors) == 2 * (4 + 2 * 5 + 2) and all(".lora_" in k for k in tensors), sorted(tensors)[:4]
    assert tensors["language_model.decoder.layers.self_attention.linear_qkv.lora_a"].shape[:2] == (2, 4)
    resumed = new_dir("lora_resumed")
    export_dir = resumed + "/hf"
    # resumed without the LoRA flags: the checkpoint's settings are taken and said (issue 55 item 4)
    assert BASE[-6:] == ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", TARGETS]
    proc = torchrun(1, ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--output-dir", resumed,
                        *BASE[:-6], "--train-iters", "4", "--component", "language=dp=1", "--component",
                        "images=dp=1", "--load-checkpoint", ck, "--export-hf", export_dir])
    assert (f"mimo-sft: LoRA settings from the checkpoint: --lora-rank 4 --lora-alpha 8 --lora-dropout 0 "
            f"--lora-target-modules {TARGETS}\n") in proc.stdout, proc.stdout
    a = {m["step"]: m for m in metrics(reference)}
    b = {m["step"]: m for m in metrics(resumed)}
    assert sorted(b) == [3, 4]
    for step in b:
        assert b[step]["loss"] == a[step]["loss"] and b[step]["grad_norm"] == a[step]["grad_norm"], step
    end_a = checkpoint_tensors(reference + "/checkpoints/iter_0000004")
    end_b = checkpoint_tensors(resumed + "/checkpoints/iter_0000004")
    assert set(end_a) == set(end_b) and all(torch.equal(end_a[k], end_b[k]) for k in end_a)
    # finetune --export-hf of a LoRA run equals `mimo-sft export` of its checkpoint
    from safetensors.torch import load_file

    cli = new_dir("lora_cli_export")
    subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", resumed + "/checkpoints", "--out", cli],
                   check=True, capture_output=True)
    x, y = load_file(export_dir + "/model.safetensors"), load_file(cli + "/model.safetensors")
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
    assert_exports_equal_in_memory_ones(resumed + "/checkpoints", cli)


@functools.lru_cache(maxsize=None)
def _tiny_qwen3_vl() -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(Path(new_dir("lora_tiny_qwen3_vl")) / "m", seed=0, family="qwen3_vl", text_layers=2))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_merged_export_of_the_default_recipe_streams_onto_the_base_weights(family):
    """Language adapters with the vision tower and projector training (the default with LoRA): the
    checkpoint holds the adapters and the whole tower; the merged export reads each group's base weights
    from the source folder (each family's decoder layers, Qwen3-VL's DeepStack mergers), the trained
    tower from the checkpoint, folds the adapters in, and equals the whole-model merge bit for bit --
    in bf16, the run's dtype, so every merged weight is rounded once. The PEFT folder, with the trained
    tower as ``modules_to_save``, equals the whole model's too."""
    from safetensors.torch import load_file

    src = tiny_model() if family == "qwen2_5_vl" else _tiny_qwen3_vl()
    out = new_dir(f"lora_default_recipe_{family}")
    flags = [*BASE[:-2], "--component", "language=dp=1", "--component", "images=dp=1", "--hf-model", src,
             "--dataset-path", demo_data(), "--output-dir", out, "--train-iters", "1", "--dtype", "bf16",
             "--export-hf", out + "/hf"]
    torchrun(1, flags)
    tensors = checkpoint_tensors(out + "/checkpoints/iter_0000001")
    assert any(k.startswith("modality_submodules.images") and ".lora_" not in k for k in tensors)
    adapter = out + "/adapter"
    subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", out + "/checkpoints", "--out", adapter,
                    "--adapter-only"], check=True, capture_output=True)
    assert json.load(open(adapter + "/adapter_config.json"))["modules_to_save"], "the trained tower is saved whole"
    merged = assert_exports_equal_in_memory_ones(out + "/checkpoints", out + "/hf", adapter)
    base = load_file(os.path.join(src, "model.safetensors"))
    changed = {k for k in merged if not torch.equal(merged[k], base[k].to(merged[k].dtype))}
    assert any(".visual." in k or k.startswith("visual.") for k in changed), "the trained tower is exported"
    assert any("q_proj" in k for k in changed) and all(merged[k].dtype == torch.bfloat16 for k in merged)


def test_default_targets_with_a_frozen_tower_resume_and_export_adapters():
    """The usual recipe: language adapters only (--freeze-vision --freeze-projector leave the images
    module nothing to train) with adapter dropout, saved, resumed exactly (the dropout stream is
    restored), and written as a PEFT adapter."""
    flags = [*BASE[:-2], "--lora-dropout", "0.1", "--freeze-vision", "--freeze-projector", "--component", "language=dp=1",
             "--component", "images=dp=1", "--hf-model", tiny_model(), "--dataset-path", demo_data()]
    assert BASE[-2] == "--lora-target-modules"  # default targets: the four language linears
    cont, resumed = new_dir("lora_lang_cont"), new_dir("lora_lang_resumed")
    torchrun(1, [*flags, "--output-dir", cont, "--train-iters", "2", "--save-interval", "1"])
    torchrun(1, [*flags, "--output-dir", resumed, "--train-iters", "2",
                 "--load-checkpoint", cont + "/checkpoints/iter_0000001"])
    a, b = metrics(cont)[1], metrics(resumed)[0]
    assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"], (a, b)
    # --pretrained-checkpoint of a LoRA checkpoint: the base from --hf-model, the trained adapters on top
    # (step 1 sees the same batch and dropout as the first run's step 1, only the adapters differ)
    again = new_dir("lora_lang_pretrained")
    torchrun(1, [*flags, "--output-dir", again, "--train-iters", "1",
                 "--pretrained-checkpoint", cont + "/checkpoints/iter_0000001"])
    assert metrics(again)[0]["loss"] < metrics(cont)[0]["loss"] - 1e-4
    tensors = checkpoint_tensors(cont + "/checkpoints/iter_0000002")
    assert sorted(k.rsplit(".", 2)[-2] for k in tensors) == sorted(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] * 2)
    adapter = new_dir("lora_lang_adapter")
    proc = subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", cont + "/checkpoints",
                           "--out", adapter, "--adapter-only"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from safetensors.torch import load_file

    names = load_file(adapter + "/adapter_model.safetensors")
    assert len(names) == 2 * 2 * 7 and all(".language_model.layers." in k for k in names)


def test_exports_reproduce_training_logits_in_transformers_and_peft(reference):
    """Merged HF folder -> transformers, adapter folder -> peft on the base model: both give the
    logits of the training model (megatron, adapters unmerged) with the checkpoint loaded."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.lora_export import build_lora_model
    from mimo_sft.train.checkpoint.save import load_model_weights

    ck = reference + "/checkpoints/iter_0000004"
    merged, adapter = new_dir("lora_merged"), new_dir("lora_adapter")
    for out, extra in ((merged, []), (adapter, ["--adapter-only"])):
        proc = subprocess.run([sys.executable, "-m", "mimo_sft", "export", "--checkpoint", ck, "--out", out, *extra],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = json.load(open(adapter + "/adapter_config.json"))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8

    def hf_model(path):
        return AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()

    base = hf_model(tiny_model())
    batch = random_batch(base.config, seed=5)
    pos = hf_position_ids(base, batch)
    base_logits, _ = hf_forward(base, batch)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    n_lora = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert n_lora == 2 * (7 + 5) + 2  # q, k, v, o, gate, up, down per layer; qkv, proj, 3 MLP per block; merger
    peft_logits, _ = hf_forward(peft_model, batch)
    merged_logits, _ = hf_forward(hf_model(merged), batch)

    model, info, _ = build_lora_model(tiny_model(), json.load(open(ck + "/meta.json"))["lora"])
    load_model_weights(model, ck)
    model.eval()
    ours = mimo_forward(model, info, batch, pos)
    mask = batch["attention_mask"]
    assert compare(merged_logits, ours, mask) < 1e-5
    assert compare(peft_logits, ours, mask) < 1e-5
    assert compare(base_logits, ours, mask) > 1e-3  # the adapters matter: a dropped one would be seen


@pytest.mark.parametrize("kind", ["model_metadata", "optimizer_metadata", "rank_file"])
def test_a_planted_lora_checkpoint_is_refused_by_every_reader(reference, kind, tmp_path):
    """A LoRA checkpoint (adapters only in model/) with a payload in one file a load reads: resume,
    ``checkpoint info --verify`` and (model/'s metadata) the adapter export refuse it in one line, running
    nothing (train.checkpoint.trusted; the full checkpoint's paths: test_checkpoint_trust.py)."""
    from checkpoint_payloads import assert_refused, planted
    from train_helpers import python_m

    folder, marker, refused = planted(reference + "/checkpoints/iter_0000002", tmp_path, kind)
    assert_refused(python_m(["checkpoint", "info", "--verify", folder]), refused, marker)
    resume = ["finetune", "--hf-model", tiny_model(), "--dataset-path", demo_data(), "--output-dir",
              new_dir(f"lora_planted_{kind}"), *BASE, "--train-iters", "4", "--component", "language=dp=1",
              "--component", "images=dp=1", "--no-save", "--load-checkpoint", folder]
    assert_refused(python_m(resume), refused, marker)
    if kind == "model_metadata":
        proc = python_m(["export", "--checkpoint", folder, "--out", str(tmp_path / "peft"), "--adapter-only"])
        assert_refused(proc, refused, marker)
