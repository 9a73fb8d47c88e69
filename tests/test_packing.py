"""In-batch packing and the SDPA attention core, in one process (no torchrun).

* ``SDPAttention`` equals megatron's local ``DotProductAttention`` on padded rows (GQA, several
  shapes), and on packed rows (one SDPA call for all samples) equals running each sample alone: no
  token sees another sample.
* ``pack_micro_batch`` keeps every real token, label, loss-mask entry and mRoPE position in order.
* The whole MimoModel (vision tower, mRoPE, GQA, LM head, loss) on a packed micro-batch of mixed
  image sizes, several images per sample and a text-only sample gives the padded run's per-token loss
  and every parameter's gradient (fp32, relative 1e-5); the local core gives the same numbers.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import make_tiny_hf


@pytest.fixture(scope="module")
def megatron_ready():
    from mimo_sft.parallel.bootstrap import start_single_process

    return start_single_process()


def _config(heads=4, groups=2, head_dim=8):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                             use_cpu_initialization=True, variable_seq_lengths=True,
                             moe_token_dispatcher_type="alltoall", masked_softmax_fusion=False)


def _cores(cfg, state):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mimo_sft.model.attention import SDPAttention

    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
              pg_collection=state.modules["language"].pg_collection)
    return SDPAttention(**kw), DotProductAttention(**kw)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_core_equals_megatron_local_core_on_padded_rows(megatron_ready, heads, groups):
    cfg = _config(heads, groups)
    ours, local = _cores(cfg, megatron_ready)
    g = torch.Generator().manual_seed(0)
    s, b, d = 11, 3, cfg.kv_channels
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
    out = ours(q, k, v, None)
    ref = local(q, k, v, None)
    assert out.shape == ref.shape == (s, b, heads * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_sdpa_core_refuses_attention_dropout_in_training(megatron_ready):
    """Training builds attention_dropout=0; a core asked for dropout must not silently skip it."""
    cfg = _config(4, 2)
    cfg.attention_dropout = 0.1
    ours, _ = _cores(cfg, megatron_ready)
    q = torch.randn(3, 1, 4, cfg.kv_channels)
    k = v = torch.randn(3, 1, 2, cfg.kv_channels)
    with pytest.raises(AssertionError, match="attention dropout"):
        ours(q, k, v, None)
    ours.eval()
    assert ours(q, k, v, None).shape == (3, 1, 4 * cfg.kv_channels)


def test_packed_attention_equals_each_sample_alone(megatron_ready):
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = _config(4, 2)
    ours, local = _cores(cfg, megatron_ready)
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9, 3]
    d = cfg.kv_channels
    q = torch.randn(sum(lengths), 4, d, generator=g)
    k, v = (torch.randn(sum(lengths), 2, d, generator=g) for _ in range(2))
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    packed = ours(q, k, v, None, packed_seq_params=params)
    assert packed.shape == (18, 4 * d)
    with torch.profiler.profile() as prof:  # one SDPA call for the four samples, not one per sample
        ours(q, k, v, None, packed_seq_params=params)
    assert sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events()) == 1
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = local(q[start:end, None], k[start:end, None], v[start:end, None], None)[:, 0]
        torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-6)
    # a packed core that ignored cu_seqlens (one causal sequence) differs: the test can fail
    whole = local(q[:, None], k[:, None], v[:, None], None)[:, 0]
    assert not torch.allclose(packed[5:], whole[5:], atol=1e-4)


def test_pack_micro_batch_keeps_every_real_position_in_order():
    from mimo_sft.train.packing import computed_positions, pack_micro_batch

    attn = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    ids = torch.arange(15).reshape(3, 5)
    pos = torch.stack([ids * 10, ids * 100, ids * 1000])
    batch = dict(input_ids=ids, labels=ids + 1, loss_mask=attn.float(), attention_mask=attn, position_ids=pos,
                 pixel_values=torch.ones(4, 2))
    packed, kw = pack_micro_batch(batch)
    real = [0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert packed["input_ids"].tolist() == [real]
    assert packed["labels"].tolist() == [[r + 1 for r in real]]
    assert packed["position_ids"].shape == (3, 1, 9)
    assert packed["position_ids"][2, 0].tolist() == [r * 1000 for r in real]
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 8, 9] and kw["max_seqlen_q"] == 5
    assert packed["pixel_values"] is batch["pixel_values"]
    assert computed_positions(batch, packed=False) == 15 and computed_positions(batch, packed=True) == 9
    left_padded = dict(batch, attention_mask=attn.flip(1))
    with pytest.raises(AssertionError, match="right-padded"):
        pack_micro_batch(left_padded)


@pytest.mark.parametrize("keep_padding", [False, True])
def test_real_positions_mark_the_micro_batchs_tokens_in_the_cp_packing(keep_padding):
    """``real_positions``: which positions of the cp packing (documents padded to multiples of 2 cp, rows whole with
    ``keep_padding``) are real tokens: exactly the attention mask's, in order (the load-balancing loss under cp
    counts these)."""
    from mimo_sft.train.packing import pack_documents, real_positions

    attn = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    ids = torch.arange(20).reshape(4, 5) + 100
    pos = torch.stack([ids, ids, ids])
    batch = dict(input_ids=ids, labels=ids, loss_mask=attn.float(), attention_mask=attn, position_ids=pos)
    packed, kw, rows = pack_documents(batch, cp=2, keep_padding=keep_padding)
    real = real_positions(attn, rows, kw["cu_seqlens_q"])
    assert real.dtype == torch.bool and real.shape == rows.shape
    assert packed["input_ids"][0][real].tolist() == ids[attn].tolist()
    assert int(real.sum()) == int(attn.sum()) and bool((rows[real] >= 0).all())


def _loss_and_grads(model, info, batch, pos, *, packed: bool):
    from mimo_sft.model.family import modality_inputs_from_batch
    from mimo_sft.train.packing import pack_micro_batch

    model.zero_grad(set_to_none=True)
    kwargs = {}
    feed = dict(batch, position_ids=pos)
    if packed:
        feed, kwargs = pack_micro_batch(feed)
    out, mask = model(input_ids=feed["input_ids"], position_ids=feed["position_ids"], attention_mask=None,
                      loss_mask=feed["loss_mask"], labels=feed["labels"],
                      modality_inputs=modality_inputs_from_batch(batch, info.encoder_name), packing_kwargs=kwargs or None)
    loss = (out * mask).sum() / mask.sum()
    loss.backward()
    per_token = out.detach()[mask.bool()]
    return per_token, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_packed_model_step_equals_padded_per_parameter(tmp_path, attention):
    """Mixed image sizes, two images in one sample, a text-only sample; packed = padded exactly.

    Run for both cores on the padded side (the local core is the reference the SDPA core replaces);
    the packed side always runs the SDPA core.
    """
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import random_batch
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter

    hf_dir = make_tiny_hf(str(tmp_path / "m"), heads=4, kv_heads=2, tie=False)
    cfg = Qwen25VLAdapter().load_hf_config(hf_dir, {})
    m = cfg.vision_config.spatial_merge_size
    batch = random_batch(cfg, seed=5, image_grids=[[(2 * m, 3 * m)], [(m, m), (3 * m, m)]], text_only=2, text_len=6)
    # long-tailed lengths: cut one text-only row short, so rows have four different real lengths
    batch["attention_mask"][-1, 9:] = False
    batch["loss_mask"][-1, 8:] = 0
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model.check import hf_position_ids

    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    pos = hf_position_ids(hf, batch)
    del hf
    padded_model, info = build_single_process_model(hf_dir, attention=attention)
    padded_loss, padded_grads = _loss_and_grads(padded_model, info, batch, pos, packed=False)
    packed_model, _ = build_single_process_model(hf_dir, attention="sdpa")
    packed_loss, packed_grads = _loss_and_grads(packed_model, info, batch, pos, packed=True)
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    assert padded_grads.keys() == packed_grads.keys() and len(padded_grads) > 20
    vision = [n for n in padded_grads if "modality_submodules" in n]
    assert vision, "the vision tower must receive gradients"
    for name, ref in padded_grads.items():
        got = packed_grads[name]
        scale = ref.abs().max().clamp_min(1e-12)
        assert float((got - ref).abs().max() / scale) <= 1e-5, name
