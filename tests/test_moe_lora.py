"""LoRA on Qwen3-VL-MoE against PEFT on transformers' ``Qwen3VLMoeForConditionalGeneration``, one process.

The default targets adapt attention (``linear_qkv``, ``linear_proj``) on every layer and the MLP only on
dense layers: a sparse layer's experts and router stay frozen (``model.lora``). The tiny checkpoint has
three layers, the middle one dense (``mlp_only_layers``). The adapter, written in PEFT's format, gives our
logits in ``PeftModel`` (fp32, 1e-5), PEFT wraps the same linears, and the forecast counts our adapters.
"""

from __future__ import annotations

import json

import pytest

from model_helpers import hf_eager, perturbed_tiny_checkpoint, trained_lora_model

TOL = 1e-5
BATCH = dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)]], text_only=1, text_len=30)
PEFT_PREFIX = "base_model.model."


def _middle_layer_dense(cfg: dict) -> None:
    cfg["text_config"]["mlp_only_layers"] = [1]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # routers moved by 0.5, every other tensor (norms included) by 0.03
    return perturbed_tiny_checkpoint(tmp_path_factory, "qwen3_vl_moe", text_layers=3, norm_scale=0.03,
                                     edit_config=_middle_layer_dense)


def test_peft_adapter_gives_our_logits_and_experts_stay_frozen(moe_dir, tmp_path):
    from peft import PeftModel

    from mimo_sft.memory.dims import TextDims, language_stage_lora_params
    from mimo_sft.model.check import compare, hf_forward, hf_position_ids, mimo_forward, random_batch
    from mimo_sft.model.lora import lora_modules
    from mimo_sft.model.lora_export import write_peft_adapter

    model, info, spec = trained_lora_model(moe_dir)
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

    base = hf_eager(moe_dir)
    batch = random_batch(base.config, seed=8, **BATCH)
    ours = mimo_forward(model, info, batch, hf_position_ids(base, batch))
    write_peft_adapter(model, info, spec, moe_dir, str(tmp_path / "adapter"))
    peft = PeftModel.from_pretrained(hf_eager(moe_dir), str(tmp_path / "adapter")).eval()
    assert compare(hf_forward(peft, batch)[0], ours, batch["attention_mask"]) <= TOL
    assert compare(hf_forward(base, batch)[0], ours, batch["attention_mask"]) > 1e-3
    wrapped = {n[len(PEFT_PREFIX):] for n, m in peft.named_modules() if hasattr(m, "lora_A") and "lora_" not in n
               and n.startswith(PEFT_PREFIX + "model.language_model.")}
    assert wrapped == {f"model.language_model.layers.{i}.self_attn.{x}" for i in range(3)
                       for x in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        f"model.language_model.layers.1.mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")}
