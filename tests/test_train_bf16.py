"""bf16 training under torchrun (gloo, CPU): what a GPU run's mixed precision must keep.

megatron's mixed-precision optimizers keep fp32 main weights apart from the bf16 model. They are
copied from the model when the optimizer is built, so weights loaded afterwards must be pushed into
them, and a checkpoint must carry them. These tests fail when either is lost:

* resume: a run stopped after a checkpoint and resumed reproduces the continuous run bit for bit
  (losses, grad norms, bf16 weights, the optimizer state with the fp32 main weights it saves next,
  and the RNG streams), plain and distributed optimizer;
* ``--pretrained-checkpoint`` in bf16 trains from the loaded weights, not from the HF ones.

bf16 matmuls are slow on these CPUs: short sequences, few steps.
"""

import math

import numpy as np
import pytest
import torch

from train_helpers import checkpoint_tensors, demo_data, metrics, new_dir, optimizer_tensors, tiny_model, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]

COMMON = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--dataloader-type", "cyclic",
          "--no-tensorboard", "--seed", "5", "--dtype", "bf16", "--scalable-dp",
          "--component", "language=dp=2", "--component", "images=dp=2"]


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
    args = ["--hf-model", tiny_model(), "--dataset-path", demo_data(), *COMMON, "--train-iters", "4", "--lr", "3e-3",
            "--lr-warmup-iters", "1", "--save-interval", "2"]
    args.append("--use-distributed-optimizer" if optimizer == "distributed" else "--no-use-distributed-optimizer")
    cont, resumed = new_dir(f"bf16_cont_{optimizer}"), new_dir(f"bf16_resumed_{optimizer}")
    torchrun(2, [*args, "--output-dir", cont])
    torchrun(2, [*args, "--output-dir", resumed, "--load-checkpoint", cont + "/checkpoints/iter_0000002"])
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
    """A fp32 run moves the weights away from the HF ones; a bf16 run started from its checkpoint
    with a learning rate too small to change a bf16 weight must end where it started: the loaded
    weights in bf16. (Without refreshing the optimizer's main weights it ends at the HF weights.)"""
    base = ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--seq-length", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--dataloader-type", "cyclic", "--no-tensorboard",
            "--component", "language=dp=1", "--component", "images=dp=1", "--lr-decay-style", "constant"]
    trained = new_dir("bf16_pre_source")
    torchrun(1, [*base, "--train-iters", "2", "--lr", "2e-2", "--save-interval", "2", "--output-dir", trained])
    source = checkpoint_tensors(trained + "/checkpoints/iter_0000002")
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
