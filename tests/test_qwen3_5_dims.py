"""Qwen3.5's parameter counts (``mimo_sft.memory.dims``) against transformers' model on the meta device.

Whole counts: ``language_params`` / ``vision_params`` equal the parameters of transformers'
``Qwen3_5ForConditionalGeneration`` for tiny hybrid configs (Gated DeltaNet and gated-attention layers in
different orders, grouped and ungrouped GDN heads, tied and untied) and for Qwen3.5-27B's sizes as
Megatron-Bridge's provider states them. Per rank: what one tensor-parallel rank holds equals a brute-force
count over the same model's parameters (norms replicated, every other weight split by heads, the embedding
padded to a multiple of tp), and each pipeline stage's count equals the parameters of its own layers.
"""

from __future__ import annotations

import pytest
import torch

from mimo_sft.config.lora import LoraSpec
from mimo_sft.memory.dims import (LINEAR_ATTENTION, TextDims, VisionDims, hybrid_layer_types, language_lora_params,
                                  language_params, language_stage_lora_params, language_stage_params, vision_params)

LIN, FULL = "linear_attention", "full_attention"
TINY = {
    # GDN 2 key / 4 value heads of different head dims, 4 query / 2 KV attention heads
    "mixed": dict(layer_types=[LIN, FULL, LIN, LIN], nk=2, nv=4, dk=16, dv=24, tied=False),
    # attention first, one key head per value head, tied embeddings
    "ungrouped_tied": dict(layer_types=[FULL, FULL, LIN, LIN, LIN, LIN], nk=4, nv=4, dk=8, dv=8, tied=True),
    # the default schedule (every 4th layer full attention), from full_attention_interval
    "interval": dict(layer_types=None, nk=2, nv=6, dk=16, dv=16, tied=False, layers=8),
}
#: Qwen3.5-27B, Megatron-Bridge's provider sizes; the vision tower is transformers' Qwen3_5VisionConfig
#: default (27 blocks of 1152) with its output at the language width
SIZES_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                 num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, full_attention_interval=4)
#: parameters every tp rank holds whole: the RMSNorms (decoder, q/k, the GDN gated norm, final)
REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
              "linear_attn.norm.weight", "language_model.norm.weight")


def tiny(layer_types, nk, nv, dk, dv, tied, layers=None):
    from transformers import Qwen3_5Config

    text = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                linear_value_head_dim=dv, linear_conv_kernel_dim=4, tie_word_embeddings=tied,
                num_hidden_layers=layers or len(layer_types))
    if layer_types is None:
        text["full_attention_interval"] = 4
    else:
        text["layer_types"] = list(layer_types)
    return Qwen3_5Config(text_config=text, tie_word_embeddings=tied,
                         vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                            out_hidden_size=64, patch_size=16, num_position_embeddings=16))


def real_27b():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=SIZES_27B, vision_config=dict(out_hidden_size=5120))


def _meta_params(config) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    # tied weights are one parameter (named_parameters yields it once)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _split(params):
    vision = {n: s for n, s in params.items() if n.startswith("model.visual.")}
    return vision, {n: s for n, s in params.items() if n not in vision}


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


CONFIGS = [pytest.param(lambda k=k: tiny(**TINY[k]), id=k) for k in TINY] + [pytest.param(real_27b, id="27b")]


@pytest.mark.parametrize("make", CONFIGS)
def test_totals_equal_transformers_model(make):
    config = make()
    hf = config.to_dict()
    vision, language = _split(_meta_params(config))
    d, v = TextDims.from_config(hf), VisionDims.from_config(hf)
    assert d.layer_types == tuple(config.text_config.layer_types) and LINEAR_ATTENTION in d.layer_types
    assert v.deepstack == 0 and not any("deepstack" in n for n in vision)
    assert language_params(d) == sum(_numel(s) for s in language.values())
    assert sum(vision_params(v)) == sum(_numel(s) for s in vision.values())


def _rank_brute_force(language: dict, tp: int, vocab: int, layers: range | None = None, *, first=True,
                      last=True, tied=False, pp=1) -> int:
    """What one tp rank holds, from the model's shapes: replicated norms whole, every other decoder tensor
    split by heads (1/tp of it), the embedding / output table padded to a multiple of tp rows."""
    n = 0
    for name, shape in language.items():
        i = _layer_index(name)
        if i is not None:
            if layers is not None and i not in layers:
                continue
            assert name.endswith(REPLICATED) or shape[0] % tp == 0 or shape[-1] % tp == 0, (name, shape)
            n += _numel(shape) if name.endswith(REPLICATED) else _numel(shape) // tp
        elif name.endswith("embed_tokens.weight"):
            rows = -(-vocab // tp) * tp // tp * shape[1]
            n += (rows if first else 0) + (rows if last and tied and pp > 1 else 0)
        elif name == "lm_head.weight":
            n += -(-vocab // tp) * tp // tp * shape[1] if last else 0
        elif name.endswith("language_model.norm.weight"):
            n += _numel(shape) if last else 0
        else:
            raise AssertionError(f"unexpected language parameter {name}")
    return n


@pytest.mark.parametrize("make,tps", [(lambda: tiny(**TINY["mixed"]), (2,)),
                                      (lambda: tiny(**TINY["ungrouped_tied"]), (2,)), (real_27b, (2, 4))],
                         ids=["mixed", "ungrouped_tied", "27b"])
def test_tensor_parallel_ranks(make, tps):
    """Per-rank counts equal the brute force; over the tp ranks they add up to the total plus the
    replicated norms' tp-1 extra copies (and the vocabulary padding, none at these sizes)."""
    config = make()
    d = TextDims.from_config(config.to_dict())
    _, language = _split(_meta_params(config))
    replicated = sum(_numel(s) for n, s in language.items() if n.endswith(REPLICATED))
    for tp in tps:
        rank = language_stage_params(d, tp=tp, pp=1, stage=0)
        assert rank == _rank_brute_force(language, tp, d.vocab)
        assert d.padded_vocab(tp) == d.vocab
        assert tp * rank == language_params(d) + (tp - 1) * replicated


@pytest.mark.parametrize("name,pp", [("mixed", 2), ("mixed", 4), ("ungrouped_tied", 2), ("ungrouped_tied", 3)])
def test_pipeline_stages_hold_their_own_layer_types(name, pp):
    config = tiny(**TINY[name])
    d = TextDims.from_config(config.to_dict())
    _, language = _split(_meta_params(config))
    per = d.layers // pp
    counts = []
    for stage in range(pp):
        layers = range(stage * per, (stage + 1) * per)
        expected = _rank_brute_force(language, 1, d.vocab, layers, first=stage == 0, last=stage == pp - 1,
                                     tied=d.tied, pp=pp)
        counts.append(language_stage_params(d, tp=1, pp=pp, stage=stage))
        assert counts[-1] == expected, stage
    # the stages hold different mixes of layer types
    assert len({tuple(sorted(d.layer_type(i) for i in d.stage_layers(pp, s))) for s in range(pp)}) > 1
    assert sum(counts) == language_params(d) + (d.vocab * d.hidden if d.tied else 0)


def test_layer_types_from_the_interval_match_transformers():
    config = tiny(**TINY["interval"])
    text = config.to_dict()["text_config"]
    text.pop("layer_types")
    assert hybrid_layer_types(text) == tuple(config.text_config.layer_types)
    from mimo_sft.errors import UserError

    with pytest.raises(UserError, match="layer_types"):
        hybrid_layer_types(dict(text, layer_types=[LIN] * 3))


def test_lora_counts_follow_the_layer_types():
    """Adapters (rank r, tp 1) from the model's linears: the MLP targets on every layer; linear_qkv (q with
    its gate rows, k, v fused) and linear_proj on the attention layers, and on the GDN layers the fused
    in_proj (in_proj_qkv, z, b, a) and out_proj, which the same two targets adapt there."""
    config = tiny(**TINY["mixed"])
    d = TextDims.from_config(config.to_dict())
    _, language = _split(_meta_params(config))
    r = 4
    lora = LoraSpec(r, 8.0, 0.0, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))

    def rows(i, *names):
        return sum(language[f"model.language_model.layers.{i}.{n}.weight"][0] for n in names)

    def cols(i, name):
        return language[f"model.language_model.layers.{i}.{name}.weight"][1]

    expected = 0
    for i in range(d.layers):
        expected += r * cols(i, "mlp.gate_proj") + rows(i, "mlp.gate_proj", "mlp.up_proj") * r
        expected += r * cols(i, "mlp.down_proj") + rows(i, "mlp.down_proj") * r
        if d.layer_type(i) != LINEAR_ATTENTION:
            attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            expected += r * cols(i, "self_attn.q_proj") + rows(i, *attn) * r
            expected += r * cols(i, "self_attn.o_proj") + rows(i, "self_attn.o_proj") * r
        else:
            gdn = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a")
            expected += r * cols(i, gdn[0]) + rows(i, *gdn) * r
            expected += r * cols(i, "linear_attn.out_proj") + rows(i, "linear_attn.out_proj") * r
    assert language_stage_lora_params(d, lora, tp=1, pp=1, stage=0) == expected
    mlp_only = LoraSpec(r, 8.0, 0.0, ("linear_fc1", "linear_fc2"))
    assert language_lora_params(d, lora, 1, LINEAR_ATTENTION) > language_lora_params(d, mlp_only, 1, LINEAR_ATTENTION) > 0
