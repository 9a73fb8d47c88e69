"""LoRA on Qwen3-VL-MoE against PEFT on transformers' ``Qwen3VLMoeForConditionalGeneration``, one process.

The default targets adapt attention (``linear_qkv``, ``linear_proj``) on every layer and the MLP only on
dense layers: a sparse layer's experts and router stay frozen (``model.lora``). The tiny checkpoint has
three layers, the middle one dense (``mlp_only_layers``). The adapter, written in PEFT's format, gives our
logits in ``PeftModel`` (fp32, 1e-5), PEFT wraps the same linears, and the forecast counts our adapters.
"""

from __future__ import annotations

import json

import pytest
import torch

from mimo_sft.config.lora import DEFAULT_TARGETS, split_targets

TOL = 1e-5
BATCH = dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)]], text_only=1, text_len=30)
PEFT_PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import Qwen3VLMoeForConditionalGeneration

    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path_factory.mktemp("moelora") / "m", family="qwen3_vl_moe", text_layers=3,
                                tie_embeddings=False)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["mlp_only_layers"] = [1]
    (out / "config.json").write_text(json.dumps(cfg))
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.5 * torch.randn_like(p) if name.endswith("mlp.gate.weight") else 0.03 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return str(out)


def _hf(path: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def test_peft_adapter_gives_our_logits_and_experts_stay_frozen(moe_dir, tmp_path):
    from peft import PeftModel

    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.memory.dims import TextDims, language_stage_lora_params
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.lora import apply_lora, lora_modules
    from mimo_sft.model.lora_export import write_peft_adapter

    model, info = build_single_process_model(moe_dir)
    spec = LoraSpec(2, 6.0, 0.0, tuple(split_targets(DEFAULT_TARGETS)))
    apply_lora(model, spec, seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.eval()
    adapted = sorted(n for n, _ in lora_modules(model))
    expected = sorted([f"language_model.decoder.layers.{i}.self_attention.{x}" for i in range(3)
                       for x in ("linear_qkv", "linear_proj")]
                      + [f"language_model.decoder.layers.1.mlp.{x}" for x in ("linear_fc1", "linear_fc2")])
    assert adapted == expected
    trained = [n for n, p in model.language_model.named_parameters() if p.requires_grad]
    assert trained and all(n.endswith((".lora_a", ".lora_b")) for n in trained)
    d = TextDims.from_config(json.loads(open(f"{moe_dir}/config.json").read()))
    assert sum(p.numel() for n, p in model.language_model.named_parameters() if p.requires_grad) == \
        language_stage_lora_params(d, spec, tp=1, pp=1, stage=0)

    base = _hf(moe_dir)
    batch = random_batch(base.config, seed=8, **BATCH)
    ours = mimo_forward(model, info, batch, hf_position_ids(base, batch))
    write_peft_adapter(model, info, spec, moe_dir, str(tmp_path / "adapter"))
    peft = PeftModel.from_pretrained(_hf(moe_dir), str(tmp_path / "adapter")).eval()
    assert compare(hf_forward(peft, batch)[0], ours, batch["attention_mask"]) <= TOL
    assert compare(hf_forward(base, batch)[0], ours, batch["attention_mask"]) > 1e-3
    wrapped = {n[len(PEFT_PREFIX):] for n, m in peft.named_modules() if hasattr(m, "lora_A") and "lora_" not in n
               and n.startswith(PEFT_PREFIX + "model.language_model.")}
    assert wrapped == {f"model.language_model.layers.{i}.self_attn.{x}" for i in range(3)
                       for x in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        f"model.language_model.layers.1.mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")}
