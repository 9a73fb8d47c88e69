"""Start-up (issue 53 item 5): the clock and where its figures go, the vision tower built on its device, and
megatron's SwiGLU never compiled.

* The clock (``train.startup``): parts nest without counting twice and never add up past the total; it counts
  from the process's start (a fresh process's sleep before the import is in ``imports``); only the first step
  row carries the figures; the first micro-batch taken in set-up is the one the first step gets, counted once.
  (A real 4-rank run's banner and first row: ``tests/test_train_e2e.py``.)
* The tower (``model.tower_build``): from a checkpoint, every parameter and buffer (rotary ``inv_freq``
  included) equals transformers' own ``from_pretrained`` tower bit for bit, each family's tower class; with
  random init, the draws are the plain CPU build's; under export's meta context it stays on meta. On the
  device audit's stand-in device (a subprocess: a process picks its device once) every parameter and buffer
  is a device tensor when ``build_mimo_model`` returns, the tower's only host-to-device copies are the
  checkpoint's tensors and its buffers (random init: the buffers alone), and the values equal the CPU builds'.
* SwiGLU (``parallel.megatron_patches.swiglu_uncompiled``): new packed lengths compile nothing (dynamo's own
  counters, which see a compiled function's first call: the control), and the gradients are autograd's of the
  unfused ``silu(gate) * up`` bit for bit, the weighted (mixture-of-experts) form with fp32 weights included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEGMENT_ATTENTION = "mimo_segments_flash_api"  # model.vision_attention's name (what the builder gives the tower)


# ---- the clock --------------------------------------------------------------------------------------------
def test_parts_nest_and_stay_within_the_total(monkeypatch):
    from mimo_sft.train import startup

    now = [104.0]
    monkeypatch.setattr(startup.time, "time", lambda: now[0])
    clock = startup.StartupClock(start=100.0)
    assert clock.seconds["imports"] == 4.0
    with clock.part("model"):
        now[0] += 3.0
        with clock.part("optimizer"):
            now[0] += 2.0
        now[0] += 1.0
    with clock.part("first_batch"):
        now[0] += 0.5
    now[0] += 0.25  # in no part: the total only
    assert clock.stop() == 10.75
    m = clock.metrics()
    assert (m["startup_model_s"], m["startup_optimizer_s"], m["startup_first_batch_s"]) == (4.0, 2.0, 0.5)
    assert sum(v for k, v in m.items() if k != "startup_s") == 10.5 <= m["startup_s"]
    assert clock.line() == ("start-up 10.8 s (imports 4.0, groups 0.0, model 4.0, optimizer 2.0, data 0.0, "
                            "first batch 0.5)")
    assert "resume 1.5" in startup.StartupClock.line_of({**m, "startup_resume_s": 1.5})  # shown when there was one
    assert startup.slowest([m, {**m, "startup_s": 11.0}, m]) == (1, {**m, "startup_s": 11.0})


def test_the_clock_counts_from_the_process_start():
    """A fresh interpreter that sleeps before importing the clock: the sleep is in ``imports``."""
    code = ("import time; time.sleep(1.0)\nfrom mimo_sft.train.startup import StartupClock\n"
            "print(StartupClock().seconds['imports'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                          timeout=60, check=True)
    assert 1.0 <= float(done.stdout) < 30.0, done.stdout


def test_only_the_first_step_row_carries_the_startup_figures(tmp_path):
    from types import SimpleNamespace

    from mimo_sft.train.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), enabled=True, total_steps=100, tensorboard=False, log_interval=100)
    logger.first_row = {"startup_s": 12.5, "startup_rank": 0}
    for n in (1, 2, 3):
        logger.log(SimpleNamespace(step=n, step_time_s=0.1, to_json=lambda n=n: {"step": n, "loss": 1.0}))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 1.0, "startup_s": 12.5, "startup_rank": 0}, {"step": 2, "loss": 1.0},
                    {"step": 3, "loss": 1.0}]


def test_the_prefetched_micro_batch_is_the_first_one_fed_and_counted_once():
    from mimo_sft.train.feed import Feed

    def batch(i):
        return {"input_ids": torch.full((2, 4), i), "attention_mask": torch.ones(2, 4, dtype=torch.bool),
                "loss_mask": torch.full((2, 4), float(i + 1))}

    taken = []
    source = (taken.append(i) or batch(i) for i in range(3))
    feed = Feed(source)
    feed.prefetch()
    assert taken == [0]  # pulled in set-up
    feed.start_step()
    first, second = next(feed), next(feed)
    assert int(first["input_ids"][0, 0]) == 0 and int(second["input_ids"][0, 0]) == 1 and taken == [0, 1]
    assert feed.counters.samples == 4 and feed.counters.loss_tokens == 8 * 1 + 8 * 2
    assert int(next(feed)["input_ids"][0, 0]) == 2
    empty = Feed(iter([]))
    empty.prefetch()  # nothing to take: the first next() says so, as without the prefetch
    with pytest.raises(StopIteration):
        next(empty)


# ---- the tower --------------------------------------------------------------------------------------------
TOWER_FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]  # the three tower classes (the MoE forms reuse theirs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("towers")
    return {f: str(write_tiny_checkpoint(root / f, seed=1, family=f)) for f in TOWER_FAMILIES}


def _tower_tensors(tower) -> dict:
    return {**{n: p.detach() for n, p in tower.named_parameters()},
            **{f"buffer {n}": b for n, b in tower.named_buffers()}}


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("family", TOWER_FAMILIES)
def test_a_tower_from_a_checkpoint_is_transformers_own(checkpoints, family):
    from transformers import AutoModelForImageTextToText

    from megatron.core.fusions import fused_bias_swiglu

    from mimo_sft.model.builder import _encoders, build_single_process_model
    from mimo_sft.parallel.megatron_patches import swiglu_grad

    model, _ = build_single_process_model(checkpoints[family], prefer="cpu")
    (tower,) = _encoders(model)
    reference = AutoModelForImageTextToText.from_pretrained(checkpoints[family], dtype=torch.float32).model.visual
    ours, theirs = _tower_tensors(tower), _tower_tensors(reference)
    assert any(n.endswith("inv_freq") for n in theirs), sorted(theirs)
    _assert_same(ours, theirs)
    assert fused_bias_swiglu.swiglu_back is swiglu_grad  # the builder's SwiGLU: never compiled


def _plain_random_tower(hf_dir: str):
    """The tower as it was always built with random init: megatron's seeding, then the class on the host."""
    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.bootstrap import start_single_process

    start_single_process("cpu")
    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    params = adapter.encoder_params(adapter.load_hf_config(hf_dir, raw), attn_implementation=SEGMENT_ATTENTION)
    runtime.init_megatron(0, tp_rank=0)
    return adapter.encoder_class()(**params)


def test_random_init_makes_the_draws_it_always_made(checkpoints):
    from mimo_sft.model.builder import _encoders, build_single_process_model

    model, _ = build_single_process_model(checkpoints["qwen2_5_vl"], random_init=True, prefer="cpu")
    (tower,) = _encoders(model)
    _assert_same(_tower_tensors(tower), _tower_tensors(_plain_random_tower(checkpoints["qwen2_5_vl"])))


def test_a_meta_build_keeps_the_tower_on_meta(checkpoints):
    """Export's shape-only model (``model.export.meta_model``: a meta context, host-side parameters): the tower goes
    where megatron's parameters go, so nothing is allocated or initialised."""
    from mimo_sft.model.builder import _encoders
    from mimo_sft.model.export import meta_model

    model, _ = meta_model(checkpoints["qwen2_5_vl"])
    (tower,) = _encoders(model)
    assert {t.device.type for t in _tower_tensors(tower).values()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


def _standin_builds(out: str, hf_dir: str) -> None:
    """(Subprocess, the stand-in device) ``build_mimo_model`` from the checkpoint and with random init, then the
    tower alone with the checkpoint copied in, and with random init; what each left on the host and copied."""
    from mimo_sft.parallel import runtime
    from mimo_sft.testing.device_audit import STANDIN_DEVICE, DeviceAudit, on_device

    runtime.use_device(STANDIN_DEVICE)
    from mimo_sft.model.builder import _encoders, build_single_process_model
    from mimo_sft.model.decoder_weights import copy_into
    from mimo_sft.model.hf_checkpoint import HFCheckpoint, one_group_mapped, read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.model.tower_build import build_tower

    report = {}
    with DeviceAudit() as audit:
        for kind in ("checkpoint", "random"):
            model, _ = build_single_process_model(hf_dir, random_init=kind == "random")
            (tower,) = _encoders(model)
            tensors = _tower_tensors(tower)
            report[kind] = {"host": sorted(n for n, t in tensors.items() if not on_device(t)),
                            "values": {n: (t.inner if on_device(t) else t).clone() for n, t in tensors.items()}}
        audit.log.take()
        raw = read_config_json(hf_dir)
        adapter = get_family(raw, hf_dir=hf_dir)
        hf_cfg = adapter.load_hf_config(hf_dir, raw)
        params = adapter.encoder_params(hf_cfg, attn_implementation=SEGMENT_ATTENTION)
        ckpt = HFCheckpoint(hf_dir)
        for kind in ("checkpoint", "random"):
            tower = build_tower(adapter.encoder_class(), params, device=STANDIN_DEVICE, from_checkpoint=kind == "checkpoint")
            if kind == "checkpoint":
                weights = adapter.load_encoder(ckpt, hf_cfg)
                copy_into(tower, one_group_mapped(ckpt, [weights] if isinstance(weights, dict) else weights), where="test")
            report[kind].update(h2d=audit.log.take().h2d_copies, parameters=len(list(tower.parameters())),
                                buffers=len(list(tower.buffers())))
    torch.save(report, out)


def test_the_tower_is_born_on_the_device(checkpoints, tmp_path):
    hf_dir = checkpoints["qwen2_5_vl"]
    out = str(tmp_path / "standin.pt")
    done = subprocess.run([sys.executable, __file__, out, hf_dir], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-4000:]
    report = torch.load(out)
    from transformers import AutoModelForImageTextToText

    from_ckpt = _tower_tensors(AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).model.visual)
    random = _tower_tensors(_plain_random_tower(hf_dir))
    for kind, want in (("checkpoint", from_ckpt), ("random", random)):
        r = report[kind]
        assert r["host"] == [], (kind, r["host"])  # every parameter and buffer a device tensor from its birth
        _assert_same(r["values"], want)
        assert r["buffers"] == 2 and r["parameters"] > 20, r  # inv_freq, original_inv_freq
        # copied from the host: the checkpoint's tensors, once each, and the host-computed buffers; nothing else
        assert r["h2d"] == (r["parameters"] if kind == "checkpoint" else 0) + r["buffers"], (kind, r["h2d"], r["parameters"])


# ---- megatron's SwiGLU --------------------------------------------------------------------------------------
def test_new_packed_lengths_compile_nothing_and_the_gradients_are_autograds():
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import mimo_sft.parallel  # noqa: F401  (makes megatron importable)
    from megatron.core.fusions import fused_bias_swiglu as fused

    from mimo_sft.parallel.megatron_patches import _SWIGLU_FUNCTIONS, swiglu_uncompiled

    swiglu_uncompiled()
    assert not any(hasattr(getattr(fused, n), "_torchdynamo_orig_callable") for n in _SWIGLU_FUNCTIONS)
    counters.clear()
    for tokens, dtype in ((48, torch.float32), (80, torch.float32), (112, torch.bfloat16)):  # each a new length
        y = torch.randn(tokens, 2 * 24, generator=torch.Generator().manual_seed(tokens)).to(dtype).requires_grad_(True)
        g = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
        fused.bias_swiglu_impl(y, None).backward(g)
        plain = y.detach().clone().requires_grad_(True)
        gate, up = torch.chunk(plain, 2, -1)
        (F.silu(gate) * up).backward(g)
        assert torch.equal(y.grad, plain.grad), (tokens, dtype)
        # the mixture-of-experts experts' form: per-token fp32 weights on bf16 activations
        w = torch.rand(tokens, 1, generator=torch.Generator().manual_seed(2))
        yw = y.detach().clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        fused.weighted_bias_swiglu_impl(yw, None, ww).backward(g)
        plain_w = y.detach().clone().requires_grad_(True)
        pw = w.clone().requires_grad_(True)
        gate, up = torch.chunk(plain_w, 2, -1)
        ((F.silu(gate) * up) * pw).to(dtype).backward(g)
        tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # bf16: rounded elsewhere
        torch.testing.assert_close(yw.grad, plain_w.grad, **tol)
        torch.testing.assert_close(ww.grad, pw.grad, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 0 and counters["stats"]["calls_captured"] == 0, dict(counters["stats"])
    # the control: the same counters see a compiled function's first call (dynamo's eager backend: no inductor)
    compiled = torch.compile(lambda y: fused.swiglu(y) * 2, backend="eager")
    compiled(torch.randn(48, 48))
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])


if __name__ == "__main__":
    _standin_builds(*sys.argv[1:3])
