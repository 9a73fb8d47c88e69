"""Model building details a GPU node exposes: bf16 rotary frequencies, apex's norm, export's footprint."""

import pytest
import torch

from model_helpers import make_tiny_hf


def _rotary_modules(model):
    enc = next(iter(model.modality_submodules["images"].encoders.values()))
    return [m for m in enc.modules() if hasattr(m, "inv_freq")]


def test_bf16_vision_tower_keeps_fp32_rotary_frequencies(tmp_path):
    """``enc.to(bf16)`` would round ``inv_freq`` (0.35 % error in every position); they stay fp32 and
    equal to the fp32 build's values, while the weights are bf16."""
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model import build_single_process_model

    src = make_tiny_hf(str(tmp_path / "src"))
    fp32, _ = build_single_process_model(src)
    bf16, _ = build_single_process_model(src, model_cfg=ModelConfig(dtype="bf16"))
    want, got = _rotary_modules(fp32), _rotary_modules(bf16)
    assert want and len(want) == len(got)
    for a, b in zip(want, got):
        assert b.inv_freq.dtype == torch.float32 and torch.equal(a.inv_freq, b.inv_freq)
        assert not torch.equal(a.inv_freq.to(torch.bfloat16).float(), a.inv_freq)  # bf16 would have rounded them
    enc = next(iter(bf16.modality_submodules["images"].encoders.values()))
    assert {p.dtype for p in enc.parameters()} == {torch.bfloat16}


class _ApexLikeFusedLayerNorm(torch.nn.Module):
    """Stands in for apex's FusedLayerNorm, which megatron picks for the final norm whenever apex is
    importable and which refuses RMSNorm (the injected fault)."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__()
        assert config.normalization != "RMSNorm", "FusedLayerNorm does not support RMSNorm"


def test_language_model_builds_with_apex_installed(tmp_path, monkeypatch):
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mimo_sft.model import build_single_process_model

    monkeypatch.setattr(transformer_block, "LayerNormImpl", _ApexLikeFusedLayerNorm)
    model, _ = build_single_process_model(make_tiny_hf(str(tmp_path / "src")))
    norms = [m for m in model.language_model.modules() if isinstance(m, torch.nn.RMSNorm)]
    # every layer's two norms and the final norm are torch's RMSNorm (what WrappedTorchNorm builds)
    assert len(norms) == 2 * len(model.language_model.decoder.layers) + 1
    assert WrappedTorchNorm is not None


def test_export_builds_in_host_memory_without_initialising(tmp_path, monkeypatch):
    """Export's model comes from the checkpoint: built on the CPU with megatron's initialisation off."""
    from megatron.core.tensor_parallel import layers

    from mimo_sft.model import build_single_process_model

    calls = []
    original = layers._initialize_affine_weight_cpu
    monkeypatch.setattr(layers, "_initialize_affine_weight_cpu", lambda *a, **k: calls.append(1) or original(*a, **k))
    model, _ = build_single_process_model(make_tiny_hf(str(tmp_path / "src")), random_init=True, prefer="cpu",
                                          cpu_init=True, config_overrides={"perform_initialization": False})
    assert not calls
    assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize("prefer", ["cpu", "auto"])
def test_select_device_on_this_machine(prefer):
    from mimo_sft.parallel import runtime

    want = "cuda" if torch.cuda.is_available() and prefer == "auto" else "cpu"
    assert runtime.select_device(prefer).type == want
