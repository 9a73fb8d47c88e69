"""The device audit (``mimo_sft.testing.device_audit``): on the CPU, what a GPU run would mix and read back.

* The audit itself: a host index into a device embedding is flagged, 0-dim host scalars are not; every way of
  reading a device value back (``item``, ``tolist``, ``cpu``, ``nonzero``, boolean-mask indexing,
  ``torch.tensor`` of device scalars) is a read; ``x[mask] = 0`` is not; a bare meta tensor and a failing op
  end the audit with the op named.
* The permanent negative control: transformers' Qwen3-VL and Qwen3.5 towers handed a host ``grid_thw`` (what
  training gave them before the towers took host-built inputs: the first H200 run's crash) are flagged at
  ``pos_embed``'s ``aten.embedding``. Our encoders, given the same host grid, mix nothing, read nothing, and
  equal transformers' CPU output bit for bit, for images and a clip (forward and backward).
* Every family trains on the stand-in device (``testing.audit_run``, one subprocess): packed and padded,
  images and clips, forward, backward and optimizer step, without one mixed op; each step's reads are listed
  (the busy-GPU issue's budget counts them), and the stand-in run's losses equal a CPU run's.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from mimo_sft.testing.device_audit import STANDIN_DEVICE, DeviceAudit, StandIn, on_device

pytest.importorskip("torchvision")  # the clips of the trainer audit


def _sites(log, kind: str) -> dict:
    return log.count_by(kind, "op+site")


def test_audit_flags_mixed_ops_and_every_kind_of_read():
    bare = torch.empty(3, device="meta")  # made where the audit cannot see it: a tensor without values
    with DeviceAudit() as audit:
        weight = torch.randn(10, 4).to(STANDIN_DEVICE)
        assert on_device(weight) and weight.device == STANDIN_DEVICE and not on_device(torch.zeros(2))
        out = torch.nn.functional.embedding(torch.tensor([1, 2]), weight)  # a host index
        assert on_device(out) and torch.equal(out.inner, weight.inner[[1, 2]])
        (mixed,) = audit.log.take().mixed()
        assert mixed.op == "embedding" and "test_device_audit.py" in mixed.site
        scaled = weight * torch.tensor(2.0)  # a 0-dim host scalar: CUDA kernels take it
        made = torch.arange(4, device=weight.device) + torch.zeros(4, device=STANDIN_DEVICE)
        assert on_device(made) and on_device(scaled)
        assert not audit.log.take().findings
        mask = weight[:, 0] > 0
        weight[mask] = 0.0  # a masked fill: no read
        assert not audit.log.take().findings
        reads = [weight.sum().item(), weight[:2, 0].tolist(), weight.cpu(), mask.nonzero(), weight[mask],
                 torch.tensor([weight[0, 0], weight[1, 1]]), bool(mask.any()), weight.numpy()]
        ops = [f.op for f in audit.log.take().reads()]
        assert ops == ["_local_scalar_dense", "tolist", "_to_copy", "nonzero", "index", "tensor(device values)",
                       "tensor(device values)", "_local_scalar_dense", "numpy"], ops
        assert not on_device(reads[2]) and torch.equal(reads[2], weight.inner)
        with pytest.raises(AssertionError, match="meta tensor without values"):
            bare.add_(1)
        with pytest.raises(RuntimeError) as err:
            weight @ torch.zeros(3, 3, device=STANDIN_DEVICE)  # a failing op is not swallowed
        assert any("device audit: aten.mm" in note for note in err.value.__notes__)
    with pytest.raises(RuntimeError, match="outside the device audit"):
        weight + 1


def _tower_config(family: str):
    from transformers import Qwen3_5Config, Qwen3VLConfig

    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    if family == "qwen3_vl":
        return Qwen3VLConfig(vision_config=dict(vision, deepstack_visual_indexes=[1])).vision_config
    return Qwen3_5Config(vision_config=vision).vision_config


def _towers(family: str):
    """(transformers' tower, ours) with the same weights, both attending with our segment implementation."""
    from mimo_sft.model.qwen3_5 import Qwen35VisionEncoder
    from mimo_sft.model.qwen3_vl import Qwen3VisionEncoder
    from mimo_sft.model.vision_attention import SEGMENT_ATTENTION

    cfg = _tower_config(family)
    cfg._attn_implementation = SEGMENT_ATTENTION
    cls = Qwen3VisionEncoder if family == "qwen3_vl" else Qwen35VisionEncoder
    torch.manual_seed(0)
    ours = cls(copy.deepcopy(cfg)).float()
    with torch.no_grad():  # biases and norms away from their init, and a position table that is not flat
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias") or "pos_embed" in name:
                p.add_(0.1 * torch.randn_like(p))
    return cls.__mro__[2], ours  # transformers' class: after the mixin and ours


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_transformers_tower_given_a_host_grid_is_flagged_and_ours_is_not(family):
    """The negative control, then our encoder on the same host grid: images and a clip (t = 2)."""
    hf_class, ours = _towers(family)
    grid = torch.tensor([[1, 6, 10], [2, 4, 4], [1, 8, 2]])  # model grids: the second item is a clip
    x = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))

    def hf_forward(tower, patches):
        out = hf_class.forward(tower, hidden_states=patches, grid_thw=grid)
        return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)

    reference = hf_forward(ours, x)  # today's CPU output: transformers' own path, all on the host
    cpu_ours = ours(x, grid)
    assert torch.equal(cpu_ours, reference)  # the host-built inputs are the tower's own, bit for bit
    weight = torch.randn_like(reference, generator=torch.Generator().manual_seed(2))
    (reference * weight).sum().backward()
    cpu_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad(set_to_none=True)
    reference, cpu_ours = reference.detach(), None  # no graph left holding the parameters (they move below)

    with DeviceAudit() as audit:
        ours.to(STANDIN_DEVICE)
        patches = x.to(STANDIN_DEVICE)
        audit.log.take()
        with torch.no_grad():
            hf_forward(ours, patches)
        flagged = audit.log.take()
        mixed = _sites(flagged, "mixed")
        pos_embed = [s for s in mixed if s.startswith("embedding ") and f"models/{family}/modeling_{family}.py" in s]
        assert pos_embed, mixed  # the crash of the first GPU run, seen on the CPU

        out = ours(patches, grid)  # the training path: a host grid, inputs built on the host and moved once
        (out * weight.to(STANDIN_DEVICE)).sum().backward()
        clean = audit.log.take()
        assert not clean.findings, (_sites(clean, "mixed"), _sites(clean, "read"))
        # the same numbers (SDPA picks its math kernel for a tensor that is not on the CPU: rounding differs)
        assert on_device(out) and _rel(out.inner, reference) <= 1e-5
        for name, p in ours.named_parameters():
            assert on_device(p.grad) and _rel(p.grad.inner, cpu_grads[name]) <= 1e-5, name


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# ---- every family's training step on the stand-in device ------------------------------------------------
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"]
STEPS = 2


#: host reads a step may make (the busy-GPU issue's budget; docs/benchmarks.md, "Host reads per step"), by call
#: site: the grad norm's slot list every step, the buffered losses at each log step (every second step here), and
#: for the mixture-of-experts families megatron's alltoall dispatcher's one wait per MoE layer and micro-batch
#: (its split sizes go to the host on a side stream for the all-to-all: megatron's design) and the routing
#: figures' read per step (``train.expert_load``)
GRAD_NORM = "tolist  mimo_sft/parallel/megatron_patches.py"
LOSSES = "tolist  mimo_sft/train/step_log.py"
MOE_DISPATCH = "cuda.synchronize  megatron/core/transformer/moe/token_dispatcher.py"
MOE_FIGURES = "_to_copy  mimo_sft/train/expert_load.py"
LOG_INTERVAL = 2


def _within_budget(family: str, step: int, reads: dict, logged: dict) -> list:
    """The reads outside the budget (empty when within it)."""
    moe = family.endswith("_moe")
    allowed = {GRAD_NORM: 1, LOSSES: 0}
    if moe:
        allowed[MOE_DISPATCH] = 2  # once per MoE layer and micro-batch: the tiny models' 2 layers, 1 micro-batch
    out = [f"{n}x {site}" for site, n in reads.items()
           if n > next((v for k, v in allowed.items() if site.startswith(k)), 0)]
    allowed_log = {LOSSES: 1 if step % LOG_INTERVAL == 0 else 0, MOE_FIGURES: 1 if moe else 0}
    return out + [f"(metrics) {n}x {site}" for site, n in logged.items()
                  if n > next((v for k, v in allowed_log.items() if site.startswith(k)), 0)]


def _flags(model: str, data: str, out: str, *extra) -> list:
    return ["--hf-model", model, "--dataset-path", data, "--output-dir", out, "--component", "language=dp=1",
            "--component", "images=dp=1", "--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--train-iters", str(STEPS + 1), "--no-save", "--no-tensorboard", "--dataloader-type", "cyclic",
            "--num-workers", "0", "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "5",
            "--log-interval", str(LOG_INTERVAL), *extra]


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """One subprocess (a process chooses its device once): every family packed, and padded; Qwen2.5-VL also
    once on the CPU, as the reference of the stand-in run's losses."""
    from mimo_sft.testing.clips import write_video_dataset
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("audit")
    data = str(write_video_dataset(root / "video", samples=8, seed=3).parent)
    spec = {}
    for family in FAMILIES:
        model = str(write_tiny_checkpoint(root / family, seed=0, family=family))
        spec[f"{family} packed"] = {"flags": _flags(model, data, str(root / f"{family}_p")), "steps": STEPS}
        spec[f"{family} padded"] = {"flags": _flags(model, data, str(root / f"{family}_u"), "--no-in-batch-packing"),
                                    "steps": STEPS}
    spec["qwen3_5_moe aux-loss"] = {"flags": _flags(str(root / "qwen3_5_moe"), data, str(root / "aux"),
                                                    "--moe-aux-loss-coeff", "0.01"), "steps": STEPS}
    deep = str(write_tiny_checkpoint(root / "qwen2_5_vl_8", seed=0, text_layers=8, vision_depth=8))
    spec["qwen2_5_vl 8 layers"] = {"flags": _flags(deep, data, str(root / "deep")), "steps": STEPS}
    (root / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "mimo_sft.testing.audit_run", str(root / "report.json"),
                           str(root / "spec.json")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    reference = _cpu_losses(spec["qwen2_5_vl packed"]["flags"], str(root / "cpu"))
    return json.loads((root / "report.json").read_text()), reference


def _cpu_losses(flags: list, out: str) -> list:
    """The same run on the CPU (its own process): each step's loss from metrics.jsonl."""
    flags = list(flags)
    flags[flags.index("--output-dir") + 1] = out
    flags[flags.index("--train-iters") + 1] = str(STEPS)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "mimo_sft", "finetune", *flags], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [r["loss"] for r in rows if "loss" in r]


def _listing(report: dict) -> str:
    lines = []
    for name, run in report.items():
        lines.append(f"{name}: reads per step {[sum(s['reads'].values()) for s in run['steps']]}, "
                     f"metrics {[sum(s['reads'].values()) for s in run['logs']]}")
        for site, n in sorted(run["steps"][-1]["reads"].items()):
            lines.append(f"    {n:4d}  {site}")
    return "\n".join(lines)


def test_every_family_trains_on_the_stand_in_device_mixing_nothing(audited):
    report, reference = audited
    print(_listing(report))
    assert sorted(report) == sorted([f"{f} {m}" for f in FAMILIES for m in ("packed", "padded")]
                                    + ["qwen2_5_vl 8 layers", "qwen3_5_moe aux-loss"])
    for name, run in report.items():
        for step, (stepped, logged) in enumerate(zip(run["steps"], run["logs"]), start=1):
            over = _within_budget(name.split()[0], step, stepped["reads"], logged["reads"])
            assert not over, (name, step, over)
        for part in [run["setup"], *run["steps"], *run["logs"]]:
            assert not part["mixed"], (name, part["mixed"])
        assert len(run["losses"]) == STEPS and all(0 < loss < 20 for loss in run["losses"]), (name, run["losses"])
        seen = {k: sum(items[k] for items in run["items"]) for k in ("images", "clips")}
        assert seen["images"] > 0 and seen["clips"] > 0, (name, run["items"])
        for step in run["steps"]:  # forward, backward and the optimizer ran on the stand-in
            assert step["reads_by_phase"].get("optimizer", 0) > 0, (name, step["reads_by_phase"])
    # the optimizer phase runs a few kernels per bucket: as many at 8 layers as at 2 (step 2: Adam's state exists)
    from mimo_sft.testing.audit_run import by_group

    shallow, deep = report["qwen2_5_vl packed"], report["qwen2_5_vl 8 layers"]
    assert deep["param_tensors"] > 3 * shallow["param_tensors"], (deep["param_tensors"], shallow["param_tensors"])
    ops = [by_group(run["steps"][-1]["ops_by_phase"]) for run in (shallow, deep)]
    assert ops[0]["optimizer"] == ops[1]["optimizer"] and ops[1]["forward"] > 2 * ops[0]["forward"], ops
    # the stand-in computes what the CPU computes
    for ours, ref in zip(report["qwen2_5_vl packed"]["losses"], reference, strict=True):
        assert abs(ours - ref) <= 1e-5 * abs(ref), (report["qwen2_5_vl packed"]["losses"], reference)
