"""megatron's fused SwiGLU (``bias_activation_fusion``) in the decoder MLP: what the forecast counts is what
the model runs, it gives the unfused MLP's numbers, and it keeps three MLP-sized tensors a token, not five.

* the model's own TransformerConfig sets the fusion as ``memory.activations.FUSED_SWIGLU`` says (the
  measurement harness, ``testing.saved_bytes.language_layer``, builds layers that way);
* one decoder layer with the fusion against the same layer (same weights) without it: output and every
  parameter's gradient bit for bit, fp32 and bf16 (the fusion runs uncompiled, its backward autograd's own
  SiLU backward and product: ``parallel.megatron_patches.swiglu_grad``);
* the MLP alone at Qwen2.5-VL-7B's width: the fused path keeps the fc1 output and fc2's input (``3 b ffn``),
  the unfused one also the SiLU output and ``up + 0`` (``5 b ffn``), as ``memory.activations`` counts them.
"""

from __future__ import annotations

import pytest
import torch

from mimo_sft.memory import activations as act


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("swiglu"), text_layers=1, tie_embeddings=False))


@pytest.fixture(scope="module")
def q7b(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import preset_config

    out = tmp_path_factory.mktemp("q7b_swiglu")
    preset_config("qwen2.5-vl-7b").save_pretrained(str(out))
    return str(out)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_the_model_runs_the_swiglu_the_forecast_counts(tmp_path, family):
    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.model.registry import get_family
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    hf_dir = str(write_tiny_checkpoint(tmp_path / family, family=family, text_layers=4 if family == "qwen3_5" else 2))
    raw = read_config_json(hf_dir)
    adapter = get_family(raw, hf_dir=hf_dir)
    cfg = adapter.language_transformer_config(adapter.load_hf_config(hf_dir, raw), tp=1, pp=1, dtype=torch.float32,
                                              random_init=False, cpu_init=True, overrides={})
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert cfg.bias_activation_fusion == act.FUSED_SWIGLU, (
        "memory.activations.FUSED_SWIGLU must say what language_transformer_config sets")


def _layer(hf_dir, dtype, fused: bool):
    from mimo_sft.testing import saved_bytes as sb

    return sb.language_layer(hf_dir, dtype=dtype, extra={"bias_activation_fusion": fused})


def _step(block, cfg, x):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    tokens = x.shape[0]
    rope = MultimodalRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)
    emb = rope(torch.arange(tokens).view(1, 1, tokens).expand(3, 1, tokens), cfg.mrope_section)
    x = x.detach().requires_grad_(True)
    out = block(x, None, rotary_pos_emb=emb)
    out.float().square().mean().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_gives_the_unfused_numbers(tiny, dtype):
    torch.manual_seed(0)
    fused, cfg = _layer(tiny, dtype, True)
    plain, cfg_plain = _layer(tiny, dtype, False)
    assert cfg.bias_activation_fusion and not cfg_plain.bias_activation_fusion
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.2)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(48, 1, cfg.hidden_size).to(dtype)
    out_f, dx_f, grads_f = _step(fused, cfg, x)
    out_p, dx_p, grads_p = _step(plain, cfg_plain, x)
    # the fused path runs uncompiled with autograd's own SiLU backward (parallel.megatron_patches.swiglu_grad): the
    # unfused MLP's numbers bit for bit, in both dtypes
    tol = dict(rtol=0, atol=0)
    torch.testing.assert_close(out_f, out_p, **tol)
    torch.testing.assert_close(dx_f, dx_p, **tol)
    assert grads_f.keys() == grads_p.keys() and any("linear_fc1" in n for n in grads_f)
    for name in grads_f:
        scale = grads_p[name].float().abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(grads_f[name].float() / scale, grads_p[name].float() / scale, **tol, msg=name)


@pytest.mark.parametrize("fused", [True, False])
def test_mlp_keeps_three_or_five_mlp_tensors_a_token_at_7b_width(q7b, fused):
    from mimo_sft.config.checks.context import read_hf_config
    from mimo_sft.memory.dims import TextDims
    from mimo_sft.testing import saved_bytes as sb

    block, cfg = _layer(q7b, torch.bfloat16, fused)
    mlp = block.layers[0].mlp
    tokens = 64
    x = torch.randn(tokens, 1, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured, _ = sb.saved_bytes(mlp, x, exclude=list(mlp.parameters()))
    d = TextDims.from_config(read_hf_config(q7b))
    terms = act.language_layer_terms(d, tp=1, sp=False, b=2, swiglu_fused=fused, device="cpu")
    fc1_input = 2 * d.hidden  # the MLP's own input, kept by linear_fc1 (half of "linear inputs")
    assert measured == tokens * (fc1_input + terms["mlp"]), (measured / tokens, fc1_input + terms["mlp"])
    assert terms["mlp"] == (3 if fused else 5) * 2 * d.ffn
