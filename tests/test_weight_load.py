"""Loading the Hugging Face weights (issue 21 item 2): the vision tower is made once, in the training dtype,
without initialisation, and read one block at a time; the language model one layer at a time."""

from __future__ import annotations

import pytest
import torch

from model_helpers import make_tiny_hf


@pytest.mark.parametrize("random_init", [False, True], ids=["from_weights", "random_init"])
def test_bf16_tower_is_built_in_bf16_and_initialised_only_without_weights(tmp_path, monkeypatch, random_init):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    import mimo_sft.model.builder as builder
    import mimo_sft.model.decoder_weights as dw
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model import build_single_process_model
    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    src = make_tiny_hf(str(tmp_path / "src"), vision_depth=3)
    before_cast, inits, groups = [], [], {"language": [], "vision": []}
    cast = builder._cast_keeping_fp32_buffers
    monkeypatch.setattr(builder, "_cast_keeping_fp32_buffers",
                        lambda m, d: before_cast.extend(p.dtype for p in m.parameters()) or cast(m, d))
    init = Qwen2_5_VisionTransformerPretrainedModel._init_weights
    monkeypatch.setattr(Qwen2_5_VisionTransformerPretrainedModel, "_init_weights",
                        lambda self, module: inits.append(type(module).__name__) or init(self, module))
    copy_into = dw.copy_into

    def recording(module, tensors, *, where, **kw):
        listed = [tensors] if isinstance(tensors, dict) else list(tensors)
        groups["vision" if "vision" in where else "language"].extend(sorted(g) for g in listed)
        return copy_into(module, listed, where=where, **kw)

    monkeypatch.setattr(dw, "copy_into", recording)
    model, info = build_single_process_model(src, model_cfg=ModelConfig(dtype="bf16"), random_init=random_init)
    assert before_cast and set(before_cast) == {torch.bfloat16}  # made in bf16: the cast copies nothing
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    enc = model.modality_submodules["images"].encoders[info.encoder_name]
    assert {b.dtype for n, b in enc.named_buffers() if "inv_freq" in n} == {torch.float32}
    if random_init:
        assert inits and not groups["vision"]  # initialised by transformers, nothing read
        return
    assert not inits  # every weight comes from the checkpoint
    ref = HFCheckpoint(src)
    for name, p in enc.named_parameters():  # exactly the source's weights rounded to bf16
        assert torch.equal(p, ref.read("visual." + name).to(torch.bfloat16)), name
    vision = groups["vision"]
    assert len(vision) >= 3 + 2 and sorted(k for g in vision for k in g) == sorted(n for n, _ in enc.named_parameters())
    for g in vision:  # one block, or outside the blocks one tensor (or one layer's weight and bias)
        blocks = {".".join(k.split(".")[:2]) for k in g if k.startswith("blocks.")}
        assert (len(blocks) == 1 and all(k.startswith("blocks.") for k in g)) or (not blocks and len(g) <= 2), g
    layers = [g for g in groups["language"] if any(".layers." in k for k in g)]
    assert len(layers) == 2 and all(len({k.split(".")[2] for k in g}) == 1 for g in layers)
