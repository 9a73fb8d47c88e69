"""bf16 training under torchrun (gloo, CPU): what a GPU run's mixed precision must keep.

megatron's mixed-precision optimizers keep fp32 main weights apart from the bf16 model. They are
copied from the model when the optimizer is built, so weights loaded afterwards must be pushed into
them, and a checkpoint must carry them. These tests fail when either is lost:

* resume: a run stopped after a checkpoint and resumed reproduces the continuous run bit for bit
  (losses, grad norms, bf16 weights, the optimizer state with the fp32 main weights it saves next,
  and the RNG streams), plain and distributed optimizer;
* resume on another layout (2 colocated ranks -> 1, distributed optimizer) restores the fp32 main
  weights the checkpoint holds;
* ``--pretrained-checkpoint`` in bf16 trains from the loaded weights, not from the HF ones.

Each continuous run serves its resume test and (distributed) the relayout test; the fp32 source of
the pretrained test is the stopping tests' never-stopped run (``tests/e2e_runs.py``).

bf16 matmuls are slow on these CPUs: short sequences, few steps.
"""

import math

import numpy as np
import pytest
import torch

from e2e_runs import (GROUP_STOP, RELAYOUT_NOTICE, SINGLE, assert_continues, finetune, never_stopped, shared_run)
from train_helpers import checkpoint_tensors, demo_data, metrics, new_dir, optimizer_tensors, tiny_model, torchrun

pytestmark = [pytest.mark.e2e, GROUP_STOP]

COMMON = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--dataloader-type", "cyclic",
          "--no-tensorboard", "--seed", "5", "--dtype", "bf16", "--scalable-dp"]
COLOCATED = ("language=dp=2", "images=dp=2")
SCHEDULE = ["--train-iters", "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--save-interval", "2"]
OPTIMIZER = {"plain": "--no-use-distributed-optimizer", "distributed": "--use-distributed-optimizer"}


def _continuous(optimizer: str) -> str:
    """2 colocated ranks, 4 bf16 steps, checkpoints at 2 and 4."""
    return shared_run(f"bf16_cont_{optimizer}", 2, [*COMMON, *SCHEDULE, OPTIMIZER[optimizer]], components=COLOCATED).out


def _assert_same_tree(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_bf16_resume_reproduces_the_continuous_run(optimizer):
    cont = _continuous(optimizer)
    resumed = finetune(f"bf16_resumed_{optimizer}", 2, [*COMMON, *SCHEDULE, OPTIMIZER[optimizer], "--load-checkpoint",
                                                        cont + "/checkpoints/iter_0000002"], components=COLOCATED).out
    a = {m["step"]: m for m in metrics(cont)}
    b = {m["step"]: m for m in metrics(resumed)}
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert (b[step]["loss"], b[step]["grad_norm"]) == (a[step]["loss"], a[step]["grad_norm"]), step
    wa = checkpoint_tensors(cont + "/checkpoints/iter_0000004")
    wb = checkpoint_tensors(resumed + "/checkpoints/iter_0000004")
    assert wa.keys() == wb.keys()
    assert {v.dtype for v in wa.values()} == {torch.bfloat16}
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    for rank in (0, 1):  # every RNG stream
        name = f"/checkpoints/iter_0000004/rank_{rank:05d}.pt"
        sa = torch.load(cont + name, weights_only=False)
        sb = torch.load(resumed + name, weights_only=False)
        _assert_same_tree(sa, sb, f"rank {rank}")
    # optimizer state with the fp32 main weights (the plain optimizer's copies, the distributed
    # optimizer's shards gathered), bit for bit
    oa = optimizer_tensors(cont + "/checkpoints/iter_0000004")
    ob = optimizer_tensors(resumed + "/checkpoints/iter_0000004")
    assert oa.keys() == ob.keys()
    for k in oa:
        assert oa[k].dtype == ob[k].dtype and torch.equal(oa[k], ob[k]), k
    mains = _fp32_main_weights(oa)
    assert mains and all(t.dtype == torch.float32 for t in mains)
    assert any(t.numel() for t in mains)


def _fp32_main_weights(tensors: dict) -> list:
    """The fp32 main weights a bf16 checkpoint's optimizer state carries (plain: ``fp32_param``;
    distributed: ``param``, in the DP-only form the flat buffers ending in ``.param``)."""
    return [v for k, v in tensors.items()
            if ".optimizer.state.fp32_param." in k or ".optimizer.state.param." in k or k.endswith(".param")]


def test_bf16_pretrained_checkpoint_trains_from_the_loaded_weights():
    """A fp32 run (6 steps at lr 3e-3) moves the weights away from the HF ones; a bf16 run started
    from its checkpoint with a learning rate too small to change a bf16 weight must end where it
    started: the loaded weights in bf16. (Without refreshing the optimizer's main weights it ends at
    the HF weights.)"""
    base = ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--seq-length", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--dataloader-type", "cyclic", "--no-tensorboard",
            "--component", "language=dp=1", "--component", "images=dp=1", "--lr-decay-style", "constant"]
    trained = never_stopped()
    source = checkpoint_tensors(trained + "/checkpoints/iter_0000006")
    for optimizer in (["--no-use-distributed-optimizer"], ["--use-distributed-optimizer"]):
        run = new_dir("bf16_pre_run")
        torchrun(1, [*base, "--dtype", "bf16", "--train-iters", "2", "--lr", "1e-12", "--save-interval", "2",
                     "--pretrained-checkpoint", trained + "/checkpoints", "--output-dir", run, *optimizer])
        after = checkpoint_tensors(run + "/checkpoints/iter_0000002")
        assert after.keys() == source.keys()
        for k, v in source.items():
            diff = (after[k].float() - v.to(torch.bfloat16).float()).abs().max().item()
            assert diff <= 1e-9, f"{optimizer}: {k} moved {diff} from the loaded weights"
        losses = [m["loss"] for m in metrics(run)]
        assert all(math.isfinite(x) for x in losses)


def test_bf16_resume_on_another_layout_restores_the_main_weights():
    """bf16, distributed optimizer: 2 colocated ranks -> 1 rank. The resumed step runs with a
    learning rate too small to move an fp32 weight, so the fp32 main weights it saves must be the
    ones the checkpoint holds -- main weights re-derived from the bf16 model would be off by a bf16
    rounding (~4e-3 of a weight). Its loss and gradient norm are the continuous run's to bf16
    precision (bf16 matmuls and reductions in another order)."""
    cont = _continuous("distributed")
    resumed, proc = finetune("relayout_bf16_one", 1, [*COMMON, *SCHEDULE, OPTIMIZER["distributed"], "--lr", "1e-12",
                                                      "--train-iters", "3", "--load-checkpoint",
                                                      cont + "/checkpoints/iter_0000002"], components=SINGLE)
    assert RELAYOUT_NOTICE in proc.stdout
    assert_continues(cont, resumed, [3], rel=1e-3)
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
    import json

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
    assert json.load(open(as_bf16 + "/config.json"))["dtype"] == "bfloat16"
    assert json.load(open(as_fp32 + "/config.json"))["dtype"] == "float32"
    hf = AutoModelForImageTextToText.from_pretrained(as_bf16, dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
