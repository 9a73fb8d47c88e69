"""The optimizer path in a few kernels per bucket (``parallel.megatron_patches``), equal to megatron's per-tensor
fallbacks and to an independent AdamW to fp32 rounding.

* The kernel contracts against megatron's own local fallbacks (``megatron.core.utils``): the l2 norm of many
  tensors, in-place scaling by a float or a device scalar, the main-to-model copy into bf16.
* One real step (one rank, the trainer built as ``finetune`` builds it, fp32 and bf16 with the distributed
  optimizer): every parameter the optimizer updates equals a float64 AdamW applied by hand to the same gradients,
  clipped by the global norm computed by hand; the optimizer's Adam is torch's fused one.
* Adam's step counters follow their group's kernel both ways (fused: on the parameter's device; foreach: on the
  host), on the stand-in device where the two differ.
* The optimizer phase's kernels do not grow with the number of parameter tensors (aten ops counted on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed
from train_helpers import demo_data, new_dir, tiny_model


def test_kernels_keep_megatrons_contracts():
    from mimo_sft.parallel import runtime  # first: makes megatron importable

    if not runtime.device_chosen():  # megatron's fallbacks allocate on "cuda": the CPU shims serve them
        runtime.use_device(torch.device("cpu"))
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from mimo_sft.parallel.megatron_patches import _foreach_l2_norm, _foreach_scale

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=g) for shape in ((7,), (3, 5), (64, 33), (1,), (2, 3, 4))]
    buf = torch.zeros(1, dtype=torch.int)
    ours, _ = _foreach_l2_norm(0, buf, [tensors], False)
    theirs, _ = local_multi_tensor_l2_norm(0, buf, [tensors], False)
    assert ours.shape == (1,) and float(abs(ours - theirs) / theirs) <= 1e-6
    assert float(_foreach_l2_norm(0, buf, [[]], False)[0]) == 0.0

    for scale in (0.37, torch.tensor([0.37])):
        a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
        _foreach_scale(0, buf, [a, a], scale)
        local_multi_tensor_scale(0, buf, [b, b], 0.37)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    into_ours = [torch.zeros_like(t, dtype=torch.bfloat16) for t in tensors]
    into_theirs = [torch.zeros_like(t, dtype=torch.bfloat16) for t in tensors]
    _foreach_scale(0, buf, [tensors, into_ours], 1.0)
    local_multi_tensor_scale(0, buf, [tensors, into_theirs], 1.0)
    assert all(torch.equal(x, y) for x, y in zip(into_ours, into_theirs))


def _flags(out: str, *extra) -> list:
    return ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--output-dir", out,
            "--component", "language=dp=1", "--component", "images=dp=1", "--seq-length", "192",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "2e-3",
            "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "0.05",
            "--no-tensorboard", "--dataloader-type", "cyclic", "--seed", "7", "--no-save", "--num-workers", "0", *extra]


def one_step_against_a_hand_adamw(rank: int, world: int, flags: list) -> dict:
    """Build the trainer, run the schedule of one step, then compare the optimizer's step with AdamW by hand."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.parallel.megatron_patches import torch_optimizers
    from mimo_sft.train.trainer import Trainer
    from mimo_sft.validate import require_valid

    cfg = load_config(flags)
    trainer = Trainer(cfg, require_valid(cfg, world_size=1).layout)
    trainer.setup()
    try:
        opt, o = trainer.ctx.optimizer, cfg.optimizer
        opt.zero_grad()
        trainer.runner.run(trainer.num_microbatches)
        opt.prepare_grads()  # the main gradients, as step() prepares them (again: idempotent)
        groups = [(g, [(p, p.detach().clone().double(), p.grad.detach().clone().double()) for p in g["params"]])
                  for torch_opt in torch_optimizers(opt) for g in torch_opt.param_groups]
        norm = math.sqrt(sum(float((grad * grad).sum()) for _, ps in groups for _, _, grad in ps))
        coeff = min(1.0, o.clip_grad / (norm + 1e-6))
        fused = {bool(g.get("fused")) for g, _ in groups}
        ok, grad_norm, _ = opt.step()
        worst = 0.0
        for group, params in groups:
            lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
            for p, before, grad in params:
                grad = grad * coeff
                m, v = (1 - b1) * grad, (1 - b2) * grad * grad
                want = before * (1 - lr * wd) - lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps)
                worst = max(worst, float((p.detach().double() - want).abs().max() / before.abs().max().clamp_min(1.0)))
        return {"ok": ok, "grad_norm": grad_norm, "norm": norm, "coeff": coeff, "worst": worst, "fused": fused,
                "tensors": sum(len(ps) for _, ps in groups)}
    finally:
        trainer.close()


@pytest.mark.parametrize("extra", [(), ("--dtype", "bf16", "--use-distributed-optimizer")], ids=["fp32", "bf16-distopt"])
def test_one_step_equals_adamw_by_hand(extra):
    (r,) = run_distributed(one_step_against_a_hand_adamw, 1, _flags(new_dir("optk"), *extra), timeout=300)
    assert r["ok"] and r["fused"] == {True} and r["tensors"] > 20, r
    assert abs(r["grad_norm"] - r["norm"]) <= 1e-5 * r["norm"], r
    assert r["coeff"] < 1.0, r  # clipping ran
    assert r["worst"] <= 2e-6, r  # fp32 rounding of the parameters


def test_adam_steps_follow_their_kernel_both_ways():
    from mimo_sft.parallel.megatron_patches import adam_steps_on_policy
    from mimo_sft.testing.device_audit import STANDIN_DEVICE, DeviceAudit, on_device

    class Holder:  # what adam_steps_on_policy walks: module infos -> megatron optimizer -> torch optimizer
        pass

    with DeviceAudit():
        p = torch.nn.Parameter(torch.randn(5, 3).to(STANDIN_DEVICE))
        torch_opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
        torch_opt.state[p]["step"] = torch.tensor(4.0)  # a foreach checkpoint's host counter
        megatron_opt, info = Holder(), Holder()
        megatron_opt.optimizer, info.optimizer, info.is_active = torch_opt, megatron_opt, True
        mimo = Holder()
        mimo.module_infos = {"language": info}
        torch_opt.param_groups[0].update(fused=True, foreach=False)
        assert adam_steps_on_policy(mimo) == 1 and on_device(torch_opt.state[p]["step"])
        assert float(torch_opt.state[p]["step"].inner) == 4.0 and adam_steps_on_policy(mimo) == 0
        torch_opt.param_groups[0].update(fused=False, foreach=True)
        assert adam_steps_on_policy(mimo) == 1 and torch_opt.state[p]["step"].device.type == "cpu"
        assert float(torch_opt.state[p]["step"]) == 4.0
