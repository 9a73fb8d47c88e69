"""The memory forecast's Qwen3-VL terms: parameter counts against built models (transformers' 8B on the
meta device, our tiny MimoModel with and without LoRA) and activation bytes against what autograd saves
in one real-width layer (``testing.saved_bytes``: a Qwen3-VL vision block at 1152, a Qwen3-8B decoder
layer at 4096, bf16)."""

from __future__ import annotations

import pytest
import torch

from mimo_sft.config.checks.context import read_hf_config
from mimo_sft.memory import activations as act
from mimo_sft.memory.dims import (TextDims, VisionDims, language_params, language_stage_params, vision_lora_params,
                                  vision_params)


@pytest.fixture(scope="module")
def q3_8b(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import preset_config

    out = tmp_path_factory.mktemp("q3_8b")
    preset_config("qwen3-vl-8b").save_pretrained(str(out))  # config.json only
    return str(out)


@pytest.fixture(scope="module")
def q3_tiny(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("q3t") / "m", family="qwen3_vl", vision_depth=3,
                                     text_layers=2, tie_embeddings=False))


def test_8b_parameter_counts_equal_transformers_model(q3_8b):
    """8.77B (8.19B language, 0.58B vision with its three DeepStack mergers), as the model card says."""
    from transformers import Qwen3VLForConditionalGeneration

    from mimo_sft.testing.tiny_checkpoint import preset_config

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(preset_config("qwen3-vl-8b"))
    hf = read_hf_config(q3_8b)
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    total = sum(p.numel() for p in model.parameters())
    assert vision == sum(vision_params(VisionDims.from_config(hf)))
    assert total - vision == language_params(TextDims.from_config(hf))
    assert round(total / 1e9, 2) == 8.77


def test_tiny_counts_equal_the_built_model_with_and_without_lora(q3_tiny):
    from mimo_sft.config.lora import LoraSpec
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.lora import apply_lora

    hf = read_hf_config(q3_tiny)
    d, v = TextDims.from_config(hf), VisionDims.from_config(hf)
    model, info = build_single_process_model(q3_tiny)
    enc = model.modality_submodules["images"].encoders[info.encoder_name]
    tower = sum(p.numel() for n, p in enc.named_parameters() if not enc.is_projector(n))
    proj = sum(p.numel() for n, p in enc.named_parameters() if enc.is_projector(n))
    assert (tower, proj) == vision_params(v)
    assert sum(p.numel() for p in model.language_model.parameters()) == language_stage_params(d, tp=1, pp=1, stage=0)
    spec = LoraSpec(4, 8.0, 0.0, ("vision_mlp", "merger"))
    before = sum(p.numel() for p in enc.parameters())
    apply_lora(model, spec, seed=0)
    assert sum(p.numel() for p in enc.parameters()) - before == vision_lora_params(v, spec)


def test_vision_block_bytes_at_real_width(q3_8b, q3_tiny):
    from mimo_sft.testing import saved_bytes as sb

    for hf_dir, patches, dtype in ((q3_8b, 256, torch.bfloat16), (q3_tiny, 64, torch.float32)):
        block, vcfg = sb.vision_block(hf_dir, dtype=dtype)
        v, b = VisionDims.from_config(read_hf_config(hf_dir)), 2 if dtype == torch.bfloat16 else 4
        for recompute in (False, True):
            measured = sb.vision_block_saved(block, vcfg, patches, dtype=dtype, recompute=recompute)
            per = act.vision_block_input(v, b=b) if recompute else sum(act.vision_block_terms(v, b=b).values())
            # one image whose patches fill their row (a multiple of 8): the plain view keeps a little less than
            # the terms, which stay an upper bound (model.segments; memory.activations.vision_full_rows_saving)
            saving = 0 if recompute else act.vision_full_rows_saving(v, b=b)
            assert (per - saving) * patches <= measured <= per * patches, (hf_dir, recompute, measured, per * patches)


@pytest.mark.parametrize("device", act.DEVICES)
def test_decoder_layer_bytes_at_real_width(q3_8b, device):
    """Qwen3-8B's layer (q/k norms, no qkv bias, head_dim 128) at width 4096: the formula to the byte, on the
    CPU's path and on CUDA's (``saved_bytes.cuda_rms_norm_saved_tensors``: the fused RMSNorm keeps its
    inputs -- k a view of the fused QKV output, q the copy megatron reshapes out of it, 4 q heads a KV group)."""
    from mimo_sft.testing import saved_bytes as sb

    block, cfg = sb.language_layer(q3_8b, dtype=torch.bfloat16)
    tokens = 128
    measured = sb.language_layer_saved(block, cfg, tokens, dtype=torch.bfloat16, device=device)
    d = TextDims.from_config(read_hf_config(q3_8b))
    terms = act.language_layer_terms(d, tp=1, sp=False, b=2, device=device)
    assert terms["qk norm"] > 0 and measured == round(sum(terms.values()) * tokens), (measured / tokens, terms)
    if device == "cuda":
        assert terms["qk norm"] == 4 * (d.heads + d.kv_heads) + 2 * d.heads * d.head_dim


def test_shipped_qwen3_vl_config_validates_and_fits(q3_8b):
    """configs/qwen3vl_8b_6gpu_noncolocated.yaml passes every check on the public 8B config.json, and the
    forecast it quotes is the one validate prints (language 58.1, images 12.9 GiB: CUDA's kernels)."""
    import os

    from mimo_sft.validate import check_config
    from mimo_sft.config.loader import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(["--config", os.path.join(root, "configs/qwen3vl_8b_6gpu_noncolocated.yaml"),
                       "--hf-model", q3_8b, "--allow-random-init", "--gpu-memory-gb", "80"])
    result = check_config(cfg, world_size=6)
    assert result.ok, result.problems
    peaks = {m: round(f["peak_bytes"] / 2 ** 30, 1) for m, f in result.memory["modules"].items()}
    assert peaks == {"language": 58.1, "images": 12.9}, peaks
