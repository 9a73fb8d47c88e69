"""Per-module learning rates and weight decay (torchrun, gloo, CPU), checked on the weights after one step.

After one AdamW step from ``w0`` every weight moves by ``lr * u + lr * wd * w0`` (decoupled decay), and
Adam's normalised first update ``u = m / (sqrt(v) + eps)`` depends on the gradient alone, not on the
learning rate or the decay. Two runs from the same weights on the same batch therefore pin each group:
with ``--lr L`` (no decay) the move is ``L * u``; with ``--vision-lr 2L --projector-lr 3L --weight-decay W``
a vision-tower matrix must move by ``2 (L u) + 2 L W w0``, a merger matrix by ``3 (L u) + 3 L W w0``, a
norm or bias by the same factor times ``L u`` only (no decay on them), and a language matrix by
``L u + L W w0``. ``w0`` is the HF checkpoint's tensor.
"""

import pytest
import torch
from safetensors.torch import load_file

from e2e_runs import finetune
from tracker_helpers import mlflow_runs, wandb_offline_run
from train_helpers import checkpoint_tensors, metrics, tiny_model

pytestmark = [pytest.mark.e2e]  # no run shared with another test: any worker

#: rounding of a weight near 1 is ~1e-7; a wrong factor moves a weight by about L = 1e-3
L, W = 1e-3, 0.1
BASE = ["--seq-length", "160", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
        "--lr", str(L), "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--no-tensorboard",
        "--save-interval", "1", "--dataloader-type", "cyclic", "--seed", "7",
        "--component", "language=dp=1", "--component", "images=dp=1"]
ENC = "modality_submodules.images.encoders."
LANG = {  # checkpoint key (layers stacked on dim 0) -> HF key of each layer, tensors not fused on the way
    "language_model.decoder.layers.self_attention.linear_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "language_model.decoder.layers.mlp.linear_fc2.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _run(name, extra, env=None):
    out = finetune(name, 1, [*BASE, *extra], env=env).out
    return out, checkpoint_tensors(out + "/checkpoints/iter_0000001")


def test_vision_and_projector_learning_rates_and_no_decay_on_norms_and_biases():
    hf = load_file(tiny_model() + "/model.safetensors")
    # the first run also logs to both experiment trackers, offline (their packages are test requirements)
    run, plain = _run("groups_plain", ["--wandb-project", "groups", "--mlflow-experiment", "groups"],
                      env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    _, grouped = _run("groups_scaled", ["--vision-lr", str(2 * L), "--projector-lr", str(3 * L), "--weight-decay", str(W)])
    _trackers_saw_the_metrics(run)
    checked = {"tower": 0, "merger": 0, "no_decay": 0}
    for key, after in grouped.items():
        if not key.startswith(ENC):
            continue
        name = key.split(".", 4)[4]
        w0 = hf["visual." + name]
        scale = 3.0 if name.startswith("merger.") else 2.0
        decays = after.dim() > 1
        want = w0 - scale * (w0 - plain[key]) - (scale * L * W * w0 if decays else 0.0)
        torch.testing.assert_close(after, want, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
        checked["merger" if scale == 3.0 else "tower"] += 1
        checked["no_decay"] += not decays
    assert min(checked.values()) > 0, checked
    for key, hf_key in LANG.items():
        for i in range(grouped[key].shape[0]):
            w0 = hf[hf_key.format(i=i)]
            torch.testing.assert_close(grouped[key][i], w0 - (w0 - plain[key][i]) - L * W * w0, rtol=0, atol=1e-6)
    no_decay = [k for k in grouped if k.startswith("language_model.")
                and k.endswith(("layer_norm_weight", "layernorm.weight", ".bias"))]
    # decay would move each by L * W = 1e-4 of itself; other param groups may change the update's rounding
    assert len(no_decay) >= 4
    for k in no_decay:
        torch.testing.assert_close(grouped[k], plain[k], rtol=1e-6, atol=0, msg=lambda m: f"{k} decayed: {m}")


def _trackers_saw_the_metrics(run):
    (row,) = metrics(run)
    wanted = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
    wb = wandb_offline_run(run + "/wandb")
    assert wb["config"]["optimizer"]["lr"] == L
    (history,) = wb["history"]
    assert history["_step"] == 1 and {k: history[k] for k in wanted} == wanted
    (ml,) = mlflow_runs("file://" + run + "/mlruns", "groups")
    assert ml["params"]["optimizer.lr"] == str(L)
    assert {k: v[1] for k, v in ml["metrics"].items()} == wanted
