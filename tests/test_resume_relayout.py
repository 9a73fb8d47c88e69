"""Resume on another layout (torchrun, gloo, CPU): a run saved with one layout continues on another
with the continuous run's losses and gradient norms.

What a checkpoint carries across layouts: weights and optimizer state (Adam moments and step, the
fp32 main weights of a bf16 run) as megatron dist-checkpoints, the step (hence the learning rate)
and the data position. The step after the checkpoint checks the weights and the data position, the
one after it the optimizer state. Only the RNG streams restart from the seed, and this model uses
none (no dropout), so the continued run must equal the continuous one up to the reduction order of
the other layout (relative 1e-5).
"""

import math

import pytest
import torch

from train_helpers import demo_data, metrics, new_dir, optimizer_tensors, tiny_model, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]

BASE = ["--seq-length", "160", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--dataloader-type", "cyclic", "--seed", "7",
        "--no-tensorboard", "--scalable-dp", "--weight-decay", "0.05"]  # no decay on norms and biases
FOUR = ["language=dp=2", "images=dp=2,rank_offset=2"]
ONE = ["language=dp=1", "images=dp=1"]
#: 2 ranks: colocated, same DP (plain); non-colocated, DP 2 -> 1 on the same TP/PP (distributed, the DP-only
#: form it saves by default)
TWO = {"plain": ["language=dp=2", "images=dp=2"], "distributed": ["language=dp=1", "images=dp=1,rank_offset=1"]}
#: colocated with language tp 2 fed by encoder DP 2: another TP, which the DP-only form cannot take
TP2 = ["language=tp=2,dp=1", "images=dp=2"]
NOTICE = "resuming on another layout: RNG streams restart from the seed"


def _run(name, nproc, components, extra, *, iters, load=None):
    out = new_dir(name)
    args = ["--hf-model", tiny_model(), "--dataset-path", demo_data(), *BASE, "--train-iters", str(iters),
            "--output-dir", out, *extra]  # later flags win: extra may set --seq-length
    for c in components:
        args += ["--component", c]
    args += ["--save-interval", "2", *(["--load-checkpoint", load] if load else [])]
    proc = torchrun(nproc, args)
    return out, proc


def _assert_continues(cont, resumed, steps, rel=1e-5):
    a = {m["step"]: m for m in metrics(cont)}
    b = {m["step"]: m for m in metrics(resumed)}
    assert sorted(b) == steps
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert math.isclose(b[step][key], a[step][key], rel_tol=rel), (step, key, b[step][key], a[step][key])
        assert b[step]["consumed_samples"] == a[step]["consumed_samples"]
    return {s: abs(b[s]["loss"] - a[s]["loss"]) / a[s]["loss"] for s in steps}


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_resume_on_another_layout_continues_the_run(optimizer):
    extra = ["--use-distributed-optimizer" if optimizer == "distributed" else "--no-use-distributed-optimizer"]
    cont4, _ = _run(f"relayout_cont4_{optimizer}", 4, FOUR, extra, iters=4)
    ckpt4 = cont4 + "/checkpoints/iter_0000002"
    if optimizer == "distributed":
        # (a) the same layout: bit for bit, RNG streams restored, no notice (the plain optimizer's
        # same-layout resume: tests/test_train_bf16.py, tests/test_lora_e2e.py)
        same, proc = _run(f"relayout_same_{optimizer}", 4, FOUR, extra, iters=4, load=ckpt4)
        a = {m["step"]: m for m in metrics(cont4)}
        b = {m["step"]: m for m in metrics(same)}
        assert sorted(b) == [3, 4] and all((a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"])
                                           for s in b)
        assert NOTICE not in proc.stdout
        oa = optimizer_tensors(cont4 + "/checkpoints/iter_0000004")
        ob = optimizer_tensors(same + "/checkpoints/iter_0000004")
        assert oa.keys() == ob.keys() and all(oa[k].equal(ob[k]) for k in oa)
    # (b) 4 ranks -> 2 ranks (plain: colocated; distributed: DP 2 -> 1)
    two, proc = _run(f"relayout_two_{optimizer}", 2, TWO[optimizer], extra, iters=4, load=ckpt4)
    assert NOTICE in proc.stdout
    diffs = _assert_continues(cont4, two, [3, 4])
    if optimizer == "plain":
        print(f"plain: relative loss differences {diffs}")
        return
    # (c) 1 rank -> 4 ranks, against the 1-rank continuous run (saved --save-reshardable)
    reshardable = ["--save-reshardable"]
    cont1, _ = _run(f"relayout_cont1_{optimizer}", 1, ONE, extra + reshardable, iters=4)
    ckpt1 = cont1 + "/checkpoints/iter_0000002"
    four, proc = _run(f"relayout_four_{optimizer}", 4, FOUR, extra, iters=4, load=ckpt1)
    assert NOTICE in proc.stdout
    diffs.update({f"1->4 step {k}": v for k, v in _assert_continues(cont1, four, [3, 4]).items()})
    # (d) another TP: the reshardable form continues (the DP-only form is refused: test_checkpoint_info.py)
    tp2, proc = _run("relayout_tp2_distributed", 2, TP2, extra, iters=4, load=ckpt1)
    diffs.update({f"1->tp2 step {k}": v for k, v in _assert_continues(cont1, tp2, [3, 4]).items()})
    print(f"{optimizer}: relative loss differences {diffs}")


def test_bf16_resume_on_another_layout_restores_the_main_weights():
    """bf16, distributed optimizer: 2 colocated ranks -> 1 rank. The resumed step runs with a
    learning rate too small to move an fp32 weight, so the fp32 main weights it saves must be the
    ones the checkpoint holds -- main weights re-derived from the bf16 model would be off by a bf16
    rounding (~4e-3 of a weight). Its loss and gradient norm are the continuous run's to bf16
    precision (bf16 matmuls and reductions in another order)."""
    extra = ["--dtype", "bf16", "--use-distributed-optimizer", "--seq-length", "128"]
    cont, _ = _run("relayout_bf16_cont", 2, ["language=dp=2", "images=dp=2"], extra, iters=3)
    resumed, proc = _run("relayout_bf16_one", 1, ONE, [*extra, "--lr", "1e-12"], iters=3,
                         load=cont + "/checkpoints/iter_0000002")
    assert NOTICE in proc.stdout
    _assert_continues(cont, resumed, [3], rel=1e-3)
    a = optimizer_tensors(cont + "/checkpoints/iter_0000002")
    b = optimizer_tensors(resumed + "/checkpoints/iter_0000003")
    mains = [k for k in a if k.endswith(".param")]  # the DP-only form's flat fp32 main weights
    assert mains and a.keys() == b.keys()
    worst = 0.0
    for k in mains:
        assert a[k].dtype == b[k].dtype == torch.float32, k
        worst = max(worst, ((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)).item())
    assert worst < 1e-6, worst
    print(f"bf16: largest relative main-weight difference {worst:.2e}")
    _assert_exports_in_bf16(cont + "/checkpoints/iter_0000002")


def _assert_exports_in_bf16(ckpt):
    """Export writes a bf16 run's weights in bf16 by default, exactly as trained: the fp32 export of
    the same checkpoint holds only bf16-representable values (the bf16 weights, upcast) and equals
    the bf16 export upcast; config.json says bfloat16, and transformers loads it as bf16."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mimo_sft.train.export import export_checkpoint

    as_bf16 = export_checkpoint(ckpt, new_dir("export_bf16"))
    as_fp32 = export_checkpoint(ckpt, new_dir("export_fp32"), dtype="fp32")
    a, b = load_file(as_bf16 + "/model.safetensors"), load_file(as_fp32 + "/model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert a[k].dtype == torch.bfloat16 and b[k].dtype == torch.float32, k
        assert torch.equal(b[k].to(torch.bfloat16).float(), b[k]) and torch.equal(a[k].float(), b[k]), k
    import json

    assert json.load(open(as_bf16 + "/config.json"))["dtype"] == "bfloat16"
    assert json.load(open(as_fp32 + "/config.json"))["dtype"] == "float32"
    hf = AutoModelForImageTextToText.from_pretrained(as_bf16, dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
