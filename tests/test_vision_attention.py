"""One attention call per vision block (``model.vision_attention``, ``model.segments``), in one process.

The reference is transformers' own tower with its ``sdpa`` path (one SDPA call per window or image):
* Qwen2.5-VL (windowed and full-attention blocks; partial windows at the right and bottom edges, so the
  key mask matters): the encoder's output and every parameter's gradient, fp32, relative 1e-5, on
  images of mixed sizes and aspect ratios, and one SDPA call per block where transformers makes one per
  window; the window and image bounds carry host layouts, so no block reads the device.
* Qwen3-VL's tower (full attention over images, deepstack), given the implementation name and the mixin
  only: the same numbers through the fallback that reads ``cu_seqlens`` once per forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import profile

# images of one micro-batch: mixed sizes and aspect ratios (in patches), several with partial windows
GRIDS = [[1, 6, 10], [1, 4, 4], [1, 14, 6], [1, 2, 2], [1, 10, 12]]


def _sdpa_calls(fn) -> int:
    with profile() as prof:
        fn()
    return sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())


def _compare(ref_module, ours_module, run_ref, run_ours):
    """Outputs and per-parameter gradients of two towers holding the same weights (relative 1e-5)."""
    ref_out, ours_out = run_ref(), run_ours()
    assert ref_out.shape == ours_out.shape
    err = (ours_out - ref_out).detach().abs().max() / ref_out.detach().abs().max()
    assert float(err) <= 1e-5, float(err)
    weight = torch.randn_like(ref_out, generator=torch.Generator().manual_seed(3))
    (ref_out * weight).sum().backward()
    (ours_out * weight).sum().backward()
    ref_grads = dict(ref_module.named_parameters())
    checked = 0
    for name, p in ours_module.named_parameters():
        ref = ref_grads[name].grad
        assert ref is not None and p.grad is not None, name
        err = float((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert err <= 1e-5, (name, err)
        checked += 1
    return checked


def _qwen25_towers():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from mimo_sft.model.qwen2_5_vl import Qwen25VisionEncoder
    from mimo_sft.model.vision_attention import SEGMENT_ATTENTION

    vcfg = Qwen2_5_VLConfig(vision_config=dict(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3])).vision_config
    ref_cfg, ours_cfg = copy.deepcopy(vcfg), copy.deepcopy(vcfg)
    ref_cfg._attn_implementation, ours_cfg._attn_implementation = "sdpa", SEGMENT_ATTENTION
    torch.manual_seed(0)
    ref = Qwen2_5_VisionTransformerPretrainedModel(ref_cfg).float()
    with torch.no_grad():  # biases and norms away from their init so they matter
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ours = Qwen25VisionEncoder(ours_cfg).float()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == SEGMENT_ATTENTION
    return ref, ours


def test_qwen25_tower_one_call_per_block_equals_transformers_per_parameter():
    from mimo_sft.model.segments import segments_of
    from mimo_sft.model.vision_attention import host_vision_kwargs

    ref, ours = _qwen25_towers()
    grid = torch.tensor(GRIDS)
    x = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    checked = _compare(ref, ours, lambda: ref(hidden_states=x, grid_thw=grid).pooler_output, lambda: ours(x, grid))
    assert checked == len(list(ours.parameters())) > 20

    depth = len(ours.blocks)
    with torch.no_grad():
        assert _sdpa_calls(lambda: ours(x, grid)) == depth
        # transformers calls once per window in windowed blocks and once per image in full ones
        assert _sdpa_calls(lambda: ref(hidden_states=x, grid_thw=grid)) > 4 * depth

    # every bound the blocks receive already holds its layout, built on the host: no block reads the device
    kw = host_vision_kwargs(grid, ours.config, torch.device("cpu"))
    windows, images = segments_of(kw["cu_window_seqlens"]), segments_of(kw["cu_seqlens"])
    assert getattr(kw["cu_window_seqlens"], "_mimo_segments") is windows
    assert images.calls == 1 and images.count == len(GRIDS) and images.groups[0].width == 120
    assert images.groups[0].key_mask is not None
    assert windows.calls == 1 and windows.groups[0].width == 16 and windows.count > len(GRIDS)
    assert windows.groups[0].key_mask is not None  # edge windows
    assert kw["max_window_seqlen"] == 16 and kw["max_seqlen"] == 120


def test_qwen25_tower_keeps_images_apart():
    """The test can fail: attention across the micro-batch's images changes the first image's output."""
    _, ours = _qwen25_towers()
    grid = torch.tensor(GRIDS[:2])
    n0 = int(grid[0].prod())
    x = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        both = ours(x, grid)
        alone = ours(x[:n0], grid[:1])
        other = x.clone()
        other[n0:] += 1.0  # change only the second image
        changed = ours(other, grid)
    merged0 = n0 // 4
    torch.testing.assert_close(both[:merged0], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(changed[:merged0], both[:merged0], rtol=0, atol=0)
    assert not torch.allclose(changed[merged0:], both[merged0:])


def test_qwen3_vl_tower_gets_one_call_per_block_from_the_mixin():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from mimo_sft.model.vision_attention import SEGMENT_ATTENTION, SegmentAttentionTower

    class Tower(SegmentAttentionTower, Qwen3VLVisionModel):
        pass

    vcfg = Qwen3VLConfig(vision_config=dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
        deepstack_visual_indexes=[1])).vision_config
    ref_cfg, ours_cfg = copy.deepcopy(vcfg), copy.deepcopy(vcfg)
    ref_cfg._attn_implementation, ours_cfg._attn_implementation = "sdpa", SEGMENT_ATTENTION
    torch.manual_seed(0)
    ref = Qwen3VLVisionModel(ref_cfg).float()
    ours = Tower(ours_cfg).float()
    ours.load_state_dict(ref.state_dict())
    grid = torch.tensor([[1, 6, 10], [1, 4, 4], [1, 8, 2]])
    x = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))

    def run(model):
        out = model(hidden_states=x, grid_thw=grid)
        return torch.cat([out.pooler_output, *out.deepstack_features])

    checked = _compare(ref, ours, lambda: run(ref), lambda: run(ours))
    assert checked > 20
    with torch.no_grad():
        assert _sdpa_calls(lambda: run(ours)) == len(ours.blocks)
        assert _sdpa_calls(lambda: run(ref)) == len(ours.blocks) * len(grid)


def test_segment_batch_lays_segments_out_as_padded_rows():
    from mimo_sft.model.segments import PaddedRows, SegmentBatch

    lengths = [3, 9, 1]
    assert SegmentBatch([3, 0, 9, 1], torch.device("cpu")).count == 3  # an empty segment is skipped
    batch = PaddedRows(lengths, torch.device("cpu"))
    assert (batch.count, batch.width, batch.total) == (3, 16, 13) and not batch.view_only
    x = torch.arange(13.0).view(13, 1, 1).expand(13, 2, 4).contiguous()
    padded = batch.lay_out(x)
    assert padded.shape == (3, 2, 16, 4)
    # a row holds its segment, then repeats the segment's last row (finite values no real query weighs)
    assert padded[1, 0, :, 0].tolist() == [float(v) for v in range(3, 12)] + [11.0] * 7
    assert padded[2, 0, :, 0].tolist() == [12.0] * 16
    assert batch.key_mask[:, 0, 0].sum(1).tolist() == lengths
    torch.testing.assert_close(batch.gather(padded), x, rtol=0, atol=0)
    full = PaddedRows([8, 8, 8], torch.device("cpu"))  # every row full: a plain view, no index op
    y = torch.randn(24, 3, 4)
    assert full.view_only and full.key_mask is None and full.lay_out(y).data_ptr() == y.data_ptr()
    torch.testing.assert_close(full.gather(full.lay_out(y)), y, rtol=0, atol=0)


#: alike (one call), and long-tailed (one 700-token sample among short ones: several calls)
LENGTHS = {"alike": [5, 1, 12, 3], "long_tailed": [40, 700, 3, 90, 64, 1, 300, 72]}


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("causal", [False, True])
def test_segment_attention_equals_each_segment_alone(causal, lengths):
    """Forward and every input's gradient equal each segment attended alone, in one call or in groups."""
    import torch.nn.functional as F

    from mimo_sft.model.segments import SegmentBatch

    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lengths), 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=g, requires_grad=True) for _ in range(2))  # GQA: 2 kv groups
    batch = SegmentBatch(lengths, torch.device("cpu"))
    assert batch.calls == (1 if max(lengths) < 100 else 3)
    out = batch.attend(q, k, v, causal=causal, scale=0.3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    alone_out = []
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = F.scaled_dot_product_attention(*(t[sl].transpose(0, 1)[None] for t in (q, k, v)), is_causal=causal,
                                               scale=0.3, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[sl], alone, rtol=1e-5, atol=1e-6)
        alone_out.append(alone)
        start += n
    for got, want in zip(grads, torch.autograd.grad(torch.cat(alone_out).square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_long_tailed_segments_are_grouped_within_the_work_bound():
    """Groups pad to their longest member with at most SLACK more attention work (or stay under SMALL_WORK);
    a segment padded to the longest of a long-tailed batch would do far more."""
    from mimo_sft.model.segments import ALIGN, SLACK, SMALL_WORK, group_segments

    lengths = [8192] + [300] * 15 + [2000, 2100, 64]
    groups = group_segments(lengths)
    assert sorted(i for grp in groups for i in grp) == list(range(len(lengths)))
    assert len(groups) <= 4
    for grp in groups:
        width = -(-max(lengths[i] for i in grp) // ALIGN) * ALIGN
        padded, exact = len(grp) * width ** 2, sum(lengths[i] ** 2 for i in grp)
        assert padded <= (1 + SLACK) * exact or padded <= SMALL_WORK, (grp, padded / exact)
    one_call = len(lengths) * 8192 ** 2 / sum(n * n for n in lengths)
    assert one_call > 10  # what a single padded call would have cost
    assert group_segments([64] * 40 + [16] * 4) == [list(range(44))]  # windows: one call


# ---- torch's variable-length kernel: where it is chosen, and what it is handed ---------------------------------
def test_variable_length_kernel_is_chosen_only_where_it_runs():
    from mimo_sft.model.segments import use_kernel, varlen_runs, varlen_supported

    assert varlen_supported("cuda", torch.bfloat16, 128) and varlen_supported("cuda", torch.float16, 64)
    for device, dtype, head_dim, have in (("cpu", torch.bfloat16, 128, True), ("meta", torch.bfloat16, 128, True),
                                          ("cuda", torch.float32, 128, True), ("cuda", torch.bfloat16, 100, True),
                                          ("cuda", torch.bfloat16, 512, True), ("cuda", torch.bfloat16, 128, False)):
        assert not varlen_supported(device, dtype, head_dim, have), (device, dtype, head_dim, have)
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    try:
        for kind in ("auto", "sdpa"):
            use_kernel(kind)
            assert not varlen_runs(q)  # the CPU: the padded SDPA call
        use_kernel("varlen")
        with pytest.raises(RuntimeError, match="--attention-backend varlen cannot run here"):
            varlen_runs(q)
    finally:
        use_kernel("auto")


def _reference_varlen(with_window: bool):
    """torch's documented ``varlen_attn`` contract, computed per segment on the CPU (the flash kernel cannot run
    here), in the two argument forms torch versions take (``window_size=(-1, 0)`` or ``is_causal``)."""
    import torch.nn.functional as F

    seen = {}

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False, causal=False):
        seen.update(cu=cu_q, max_q=max_q, heads=(q.shape[1], k.shape[1]), gqa=enable_gqa)
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and isinstance(max_q, int) and max_q == max_k
        bounds, outs = cu_q.tolist(), []
        for a, b in zip(bounds, bounds[1:]):
            outs.append(F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=causal,
                                                       scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
        return torch.cat(outs)

    if with_window:
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                   enable_gqa=False):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, enable_gqa=enable_gqa,
                          causal=tuple(window_size) == (-1, 0))
    else:  # an older form: no GQA argument, causal as a flag
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, causal=is_causal)
    return kernel, seen


@pytest.mark.parametrize("with_window", [True, False], ids=["window_size", "is_causal"])
@pytest.mark.parametrize("causal", [False, True])
def test_variable_length_call_is_handed_the_kernels_contract(causal, with_window):
    """The packed tensors as they are, int32 bounds on the device, the longest segment as a host int, GQA by the
    kernel's flag or by repeated K/V: the result equals the padded SDPA path's."""
    from mimo_sft.model.segments import SegmentBatch, varlen_attention

    lengths = [5, 17, 3, 9]
    g = torch.Generator().manual_seed(6)
    q = torch.randn(sum(lengths), 4, 8, generator=g)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=g) for _ in range(2))
    batch = SegmentBatch(lengths, torch.device("cpu"))
    kernel, seen = _reference_varlen(with_window)
    out = varlen_attention(q, k, v, batch.cu_seqlens(), max(lengths), causal=causal, scale=0.3, kernel=kernel)
    assert batch.cu_seqlens().tolist() == [0, 5, 22, 25, 34] and batch.cu_seqlens() is batch.cu_seqlens()
    assert seen["max_q"] == 17 and seen["gqa"] == with_window and seen["heads"] == ((4, 2) if with_window else (4, 4))
    torch.testing.assert_close(out, batch.attend(q, k, v, causal=causal, scale=0.3), rtol=1e-5, atol=1e-6)


def test_varlen_asked_for_where_it_cannot_run_is_one_line_at_start_up():
    """On this CPU machine: a UserError naming the flag before any weight is read, not a traceback in a forward."""
    from mimo_sft.errors import UserError
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.segments import use_kernel

    try:
        with pytest.raises(UserError, match="--attention-backend varlen needs a CUDA GPU"):
            build_single_process_model("/nonexistent-model-folder", attention="varlen")
    finally:
        use_kernel("auto")
