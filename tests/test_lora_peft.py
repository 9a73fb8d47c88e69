"""LoRA training against an independent reference: transformers' own Qwen2.5-VL wrapped by PEFT.

Why: the other LoRA tests compare mimo-sft with itself (tp 2 with tp 1, a resume with the continuous
run) or check exports by their logits; none says that a *training step* is the one PEFT takes. Here
``mimo-sft finetune --lora-rank`` runs 3 fp32 steps under torchrun (1 process, and language tp 2 on
2 processes), saving a checkpoint after every step and every step's reduced gradients
(``--save-grads``), and the same 3 steps are taken by ``peft.get_peft_model`` on transformers'
model of the same folder, with ``torch.optim.AdamW``, on the same micro-batches:

* the same adapters: rank, alpha (alpha != rank, so a wrong scaling shows), the four language linears
  under transformers' names, and, with the tower trained, ``modules_to_save=["visual"]``. megatron
  fuses q/k/v and gate/up; one LoRA on a fused layer is PEFT LoRAs on its parts that share one A
  (``model/lora_export.py``), so the reference ties those A's (one parameter: its gradient is the sum).
* the same initial values: A as ``model/lora.py`` draws it (a generator seeded by the run's seed and
  the layer's name, uniform in +-1/sqrt(in), float64 then fp32), B = 0 (PEFT's own init).
* the same data (mimo-sft's own data path, in order), loss (sum of the token losses over the global
  batch / its supervised tokens: micro-batches accumulated), global gradient-norm clip (active: the
  norms exceed ``--clip-grad``), AdamW betas/eps, decoupled weight decay on matrices only, constant lr.

Compared per tensor at every step: loss and grad norm, every gradient (step 1: A gets none, B = 0;
steps 2-3 exercise both), every trained parameter after the step, and the set of tensors that train:
a LoRA checkpoint and ``--save-grads`` hold exactly the parameters that require grad, so the set
equal to PEFT's trainable set says no base weight was given to the optimizer (a frozen weight did
not move); the reference checks its own frozen weights bit for bit.
"""

from __future__ import annotations

import functools
import math
import re
import zlib

import pytest
import torch

from train_helpers import checkpoint_tensors, demo_data, metrics, new_dir, tiny_model, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]

STEPS, CLIP = 3, 0.25
#: lr and clip chosen so that every step clips (grad norms 0.32-0.84) and moves B by ~lr per element
FLAGS = ["--seq-length", "192", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(STEPS),
         "--lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--weight-decay", "0.1",
         "--clip-grad", str(CLIP), "--dataloader-type", "single", "--seed", "7", "--no-tensorboard",
         "--lora-rank", "4", "--lora-alpha", "8", "--save-interval", "1",
         # the tolerances below were reached on these pixels; tests/test_image_backend.py checks both backends
         "--image-backend", "pil"]
#: (a) the default targets with the tower and projector frozen: the adapters are all that trains;
#: (b) the default targets with the vision tower and projector training beside them (the default)
CONFIGS = {"adapters": ["--freeze-vision", "--freeze-projector"], "tower": []}
LAYOUTS = {"tp1": (1, ["language=dp=1", "images=dp=1"], []),
           "tp2": (2, ["language=tp=2,dp=1", "images=dp=2"], ["--scalable-dp"])}
CASES = [(c, layout) for c in CONFIGS for layout in LAYOUTS]
#: fp32: largest |mimo - peft| of a parameter, relative to the largest value of that tensor (at least 1:
#: B starts at 0 and moves by ~1e-3), and of a gradient relative to the tensor's largest gradient.
#: Reached: gradients <= 6.5e-6, parameters <= 1.7e-6 (a tower element whose step-1 gradient is ~eps:
#: Adam's g / (|g| + eps) turns its 1% rounding difference into 1e-3 of a step), losses and norms ~1e-7
PARAM_TOL, GRAD_TOL, SCALAR_TOL = 1e-5, 1e-5, 1e-5
ENC = "modality_submodules.images.encoders."
#: megatron's adapted linear -> the transformers linears it fuses (B's rows split as the weight's are)
FUSED = {"self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attention.linear_proj": ("self_attn.o_proj",),
         "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.linear_fc2": ("mlp.down_proj",)}
PEFT_TARGETS = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


# ---- the mimo-sft runs -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def mimo_run(config: str, layout: str) -> str:
    """One 3-step run per (config, layout): checkpoints after steps 1-3 and every step's gradients."""
    nproc, components, extra = LAYOUTS[layout]
    out = new_dir(f"lora_peft_{config}_{layout}")
    args = ["--hf-model", tiny_model(), "--dataset-path", demo_data(), "--output-dir", out, *FLAGS,
            *CONFIGS[config], *extra, "--save-grads", out + "/grads"]
    for c in components:
        args += ["--component", c]
    torchrun(nproc, args)
    return out


def _split_b(fused: str, b: torch.Tensor, text_cfg) -> tuple:
    """One layer's B of a fused megatron adapter -> the B of each transformers linear."""
    if fused == "self_attention.linear_qkv":
        from mimo_sft.model.decoder_weights import split_qkv

        heads, groups = text_cfg.num_attention_heads, text_cfg.num_key_value_heads
        return split_qkv(b, groups, text_cfg.hidden_size // heads, heads // groups)
    if fused == "mlp.linear_fc1":
        return torch.chunk(b, 2, dim=0)  # [gate; up], as the weight
    return (b,)


def hf_view(tensors: dict, text_cfg) -> tuple[dict, list]:
    """mimo-sft checkpoint tensors (layers stacked on dim 0) under transformers' module names, as the
    reference names them; and the keys that are neither an adapter nor a tower weight (a trained
    language base weight would be one)."""
    out, stray = {}, []
    for key, value in tensors.items():
        m = re.fullmatch(r"language_model\.decoder\.layers\.(.+)\.lora_(a|b)", key)
        if m and m.group(1) in FUSED:
            names = FUSED[m.group(1)]
            for i, layer in enumerate(value):
                parts = [layer] * len(names) if m.group(2) == "a" else _split_b(m.group(1), layer, text_cfg)
                for name, part in zip(names, parts, strict=True):
                    out[f"model.language_model.layers.{i}.{name}.lora_{m.group(2).upper()}"] = part
        elif key.startswith(ENC) and ".lora_" not in key:
            out["model.visual." + key.split(".", 4)[4]] = value  # the tower keeps transformers' names
        else:
            stray.append(key)
    return out, stray


# ---- the PEFT reference ----------------------------------------------------------------------------
def _run_config(run_dir: str):
    from mimo_sft.config.loader import config_from_dict, load_yaml

    return config_from_dict(load_yaml(run_dir + "/config.yaml"))


def _initial_a(seed: int, rank: int, key: str, n_in: int) -> torch.Tensor:
    """A as mimo-sft draws it: layout-free, seeded by the run's seed and the layer's global name."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    bound = 1.0 / math.sqrt(n_in)  # PEFT's Kaiming-uniform bound, multiplied in float64 as mimo-sft does
    return ((torch.rand(rank, n_in, generator=g, dtype=torch.float64) * 2 - 1) * bound).float()


def peft_model(cfg):
    """transformers' model of the run's folder (fp32, eager) wrapped by PEFT with the run's LoRA, its
    initial A, and the A of each fused layer's parts tied (one ``nn.Linear`` shared)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    m = cfg.model
    assert m.lora_target_modules.split(",") == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert m.freeze_vision == m.freeze_projector and m.lora_dropout == 0.0
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(m.hf_model, dtype=torch.float32,
                                                            attn_implementation="eager")
    assert hf.config.text_config.attention_dropout == 0.0  # mimo-sft trains without dropout too
    lora = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0, target_modules=PEFT_TARGETS,
                      modules_to_save=None if m.freeze_vision else ["visual"])
    pm = get_peft_model(hf, lora)
    with torch.no_grad():
        for i, layer in enumerate(pm.base_model.model.model.language_model.layers):
            for fused, names in FUSED.items():
                parts = [layer.get_submodule(n) for n in names]
                a = parts[0].lora_A["default"]
                a.weight.copy_(_initial_a(cfg.train.seed, m.lora_rank, f"language.layers.{i}.{fused}", a.in_features))
                assert all(not p.lora_B["default"].weight.any() for p in parts)  # B = 0, as mimo-sft's
                for p in parts[1:]:
                    p.lora_A["default"] = a
    return pm.train()


def peft_tensors(pm, *, grads: bool = False) -> dict:
    """The reference's trained tensors (or their gradients) under transformers' module names."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    out = {}
    for name, module in pm.base_model.model.named_modules():
        if isinstance(module, LoraLayer):
            out.update({f"{name}.lora_{ab}": getattr(module, f"lora_{ab}")["default"].weight for ab in "AB"})
        elif isinstance(module, ModulesToSaveWrapper):
            out.update({f"{name}.{n}": p for n, p in module.modules_to_save["default"].named_parameters()})
    return {k: (p.grad if grads else p).detach().clone() for k, p in out.items()}


def _micro_batches(cfg):
    """mimo-sft's own data path for one process (in order, every sample's pixels), trailing padding cut
    (rows are right-padded and attention is causal: the real tokens' results do not change)."""
    from mimo_sft.data.loader import build_microbatch_iterator
    from mimo_sft.model.pixels import float_patches, pixel_norm_from

    t = cfg.train
    it = build_microbatch_iterator(cfg.data, model_dir=cfg.model.hf_model, micro_batch_size=t.micro_batch_size,
                                   canonical_grid=1, dp_size=1, dp_rank=0, need_pixels=True, seed=t.seed,
                                   global_batch_size=t.global_batch_size, num_workers=0)
    from mimo_sft.data.processor import resolve_image_backend

    norm = pixel_norm_from(cfg.model.hf_model, resolve_image_backend(cfg.data.image_backend))  # as the run's encoder
    for b in it:
        n = int(b["attention_mask"].sum(1).max())
        kw = {k: b[k][:, :n] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "labels", "loss_mask")}
        kw["attention_mask"] = kw["attention_mask"].long()
        if b.get("pixel_values") is not None and b["pixel_values"].shape[0]:
            kw.update(pixel_values=float_patches(b["pixel_values"], norm), image_grid_thw=b["image_grid_thw"])
        yield kw


def _reference_step(pm, optimizer, batches: list, clip: float) -> dict:
    """One step: per-token loss over the global batch (micro-batches accumulated), gradients before
    the clip, the global-norm clip, AdamW."""
    optimizer.zero_grad()
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    loss = 0.0
    for b in batches:
        kw = {k: v for k, v in b.items() if k not in ("labels", "loss_mask")}
        logits = pm(**kw).logits.float()
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
        total = (per_token * b["loss_mask"].flatten()).sum()
        (total / tokens).backward()
        loss += float(total.detach())
    grads = peft_tensors(pm, grads=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if clip > 0 else None
    optimizer.step()
    return {"loss": loss / tokens, "grad_norm": norm, "grads": grads, "params": peft_tensors(pm)}


@functools.lru_cache(maxsize=None)
def peft_reference(config: str) -> tuple:
    """(transformers' text config, the reference's steps) on the 1-process run's config (what the run
    resolved and used)."""
    cfg = _run_config(mimo_run(config, "tp1"))
    o, t = cfg.optimizer, cfg.train
    torch.manual_seed(0)
    pm = peft_model(cfg)
    trainable = [p for p in pm.parameters() if p.requires_grad]  # each tied A once
    frozen = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    # megatron's standard groups: no decay on 1-D tensors (norms) and biases (1-D here too)
    optimizer = torch.optim.AdamW([{"params": [p for p in trainable if p.dim() > 1], "weight_decay": o.weight_decay},
                                   {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    assert o.lr_warmup_iters == 0 and o.lr_decay_style == "constant"
    data = _micro_batches(cfg)
    steps = []
    for _ in range(t.train_iters):
        batches = [next(data) for _ in range(t.global_batch_size // t.micro_batch_size)]
        steps.append(_reference_step(pm, optimizer, batches, o.clip_grad))
    moved = [n for n, p in pm.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    assert not moved, f"the reference moved frozen weights {moved[:3]}"
    return pm.base_model.model.config.text_config, steps


# ---- comparisons -----------------------------------------------------------------------------------
def worst(got: dict, want: dict, floor: float) -> tuple[float, str]:
    """Largest |got - want| over every tensor, relative to max(floor, largest |want| of the tensor)."""
    out = (0.0, "")
    for k in want:
        scale = max(floor, float(want[k].abs().max()))
        d = float((got[k].double() - want[k].double()).abs().max())
        d = d / scale if scale else d  # a zero gradient (A on step 1) must be zero
        out = max(out, (d, k))
    return out


def _mimo_step(config: str, layout: str, step: int, what: str) -> tuple[dict, list]:
    """The run's parameters after ``step`` or its gradients of ``step``, as :func:`hf_view` names them."""
    run = mimo_run(config, layout)
    folder = f"{run}/checkpoints/iter_{step:07d}" if what == "params" else f"{run}/grads/iter_{step:07d}"
    return hf_view(checkpoint_tensors(folder), peft_reference(config)[0])


def _moved(config: str, layout: str, keys: list) -> dict:
    """How far each of ``keys`` moved from step 1 to the last step (the failure message's numbers)."""
    run = mimo_run(config, layout)
    first, last = (checkpoint_tensors(f"{run}/checkpoints/iter_{s:07d}") for s in (1, STEPS))
    return {k: float((last[k] - first[k]).abs().max()) if k in first and k in last else None for k in keys}


@pytest.mark.parametrize("config,layout", CASES)
def test_trains_exactly_what_peft_trains(config, layout):
    """The frozen-base rule: the checkpoint and the gradients hold the reference's trainable tensors
    and nothing else (a base weight left trainable would be one more tensor, and move)."""
    _, ref = peft_reference(config)
    want = set(ref[0]["params"])
    for step in range(1, STEPS + 1):
        for what in ("params", "grads"):
            got, stray = _mimo_step(config, layout, step, what)
            assert not stray, f"step {step} {what}: base weights trained: {_moved(config, layout, stray)}"
            assert set(got) == want, (step, what, sorted(set(got) ^ want)[:6])
    towered = [k for k in want if k.startswith("model.visual.")]
    assert bool(towered) == (config == "tower"), towered[:3]


@pytest.mark.parametrize("config,layout", CASES)
def test_loss_and_grad_norm_equal_peft(config, layout):
    _, ref = peft_reference(config)
    rows = metrics(mimo_run(config, layout))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r, want in zip(rows, ref, strict=True):
        assert math.isclose(r["loss"], want["loss"], rel_tol=SCALAR_TOL), (r["step"], r["loss"], want["loss"])
        assert math.isclose(r["grad_norm"], want["grad_norm"], rel_tol=SCALAR_TOL), \
            (r["step"], r["grad_norm"], want["grad_norm"])
        assert want["grad_norm"] > CLIP, "the clip must act for the test to check it"


@pytest.mark.parametrize("config,layout", CASES)
def test_gradients_equal_peft(config, layout):
    _, ref = peft_reference(config)
    for step in range(1, STEPS + 1):
        got, _ = _mimo_step(config, layout, step, "grads")
        want = ref[step - 1]["grads"]
        diff, name = worst(got, want, floor=0.0)
        assert diff <= GRAD_TOL, f"step {step}: gradient of {name} differs by {diff:.2e} of its largest"
        for k, g in want.items():  # B = 0 on step 1: no gradient reaches A; afterwards everything has one
            assert (g.abs().max() == 0) == (step == 1 and k.endswith(".lora_A")), (step, k)


@pytest.mark.parametrize("config,layout", CASES)
def test_parameters_equal_peft_after_each_step(config, layout):
    _, ref = peft_reference(config)
    for step in range(1, STEPS + 1):
        got, _ = _mimo_step(config, layout, step, "params")
        diff, name = worst(got, ref[step - 1]["params"], floor=1.0)
        assert diff <= PARAM_TOL, f"step {step}: {name} differs by {diff:.2e}"
