"""The torch stand-ins for fla's GatedDeltaNet kernels (``mimo_sft.model.gdn_kernels``), in one process.

References, all independent of the code under test:

* the convolution: transformers' ``causal_conv1d_fn`` (a plain ``F.conv1d``) run on each segment alone,
  outputs and gradients wrt x, weight and bias, fp64 (it computes in the weight's dtype) and fp32;
* the delta rule: transformers' ``torch_chunk_gated_delta_rule`` run on each segment alone. It casts
  everything to fp32 whatever the input dtype, so that comparison is fp32 at ~1e-5. The tight check
  (fp64, 1e-10) is a token-by-token recurrence written here, itself checked against transformers'
  ``torch_recurrent_gated_delta_rule``;
* packing: a packed run must differ from the same tokens run as one sequence (the restart is real);
* megatron's whole ``GatedDeltaNet``, built on the CPU after ``install()``: a packed (``thd``) forward
  equals each segment's forward alone.

Without ``use_qk_l2norm_in_kernel`` the inputs are L2-normed before the call, as megatron does:
unnormalised keys make ``beta |k|^2`` exceed 2, where the delta rule itself diverges and no two
float orderings agree.
"""

from __future__ import annotations

import threading

import gdn_kernels_before as before
import pytest
import torch
import torch.nn.functional as F

import mimo_sft.parallel  # noqa: F401  (before anything imports megatron)
from mimo_sft.model import gdn_kernels as gk

LENGTHS = [130, 7, 64, 1]


def _hf():
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    transformers.logging.set_verbosity_error()  # the once-per-function "torch fallback" notice
    return hf


def _cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def _segments(lengths):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [slice(s, s + n) for s, n in zip(starts, lengths)]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _grads(out, leaves, weight):
    return torch.autograd.grad((out * weight).sum(), leaves)


# ---- causal_conv1d ----------------------------------------------------------------------------------
def _conv_inputs(total, dim=6, width=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, total, dim, generator=g, dtype=dtype), torch.randn(dim, width, generator=g, dtype=dtype),
            torch.randn(dim, generator=g, dtype=dtype))


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_conv_packed_equals_transformers_per_segment(activation, dtype, tol):
    hf = _hf()
    lengths = [1, 3, 70, 5, 2]
    x, w, b = _conv_inputs(sum(lengths), dtype=dtype)
    ours = _leaves(x, w, b)
    out, state = gk.causal_conv1d(ours[0], ours[1], ours[2], activation=activation, cu_seqlens=_cu(lengths))
    assert state is None and out.shape == x.shape and out.dtype == dtype
    ref_parts = []
    theirs = _leaves(x, w, b)
    for seg in _segments(lengths):
        y = hf.causal_conv1d_fn(theirs[0][:, seg].transpose(1, 2), theirs[1], theirs[2], activation=activation)
        ref_parts.append(y.transpose(1, 2))
    ref = torch.cat(ref_parts, 1)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    weight = torch.randn_like(out)
    for a, r in zip(_grads(out, ours, weight), _grads(ref, theirs, weight)):
        torch.testing.assert_close(a, r, rtol=tol, atol=tol)


def test_conv_unpacked_batch_equals_transformers():
    hf = _hf()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 90, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    out, _ = gk.causal_conv1d(x, w, activation="swish")
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_conv_states_continue_a_split_sequence():
    """Each segment's final state is its last ``width`` inputs; fed back as the initial state of the
    segment's continuation, the output equals the convolution of the unsplit segments."""
    first, second = [5, 2, 70], [3, 9, 1]
    whole = [a + b for a, b in zip(first, second)]
    x, w, b = _conv_inputs(sum(whole))
    parts = [(x[:, s][:, :n], x[:, s][:, n:]) for s, n in zip(_segments(whole), first)]
    head = torch.cat([p[0] for p in parts], 1)
    tail = torch.cat([p[1] for p in parts], 1)
    _, state = gk.causal_conv1d(head, w, b, "silu", output_final_state=True, cu_seqlens=_cu(first))
    assert state.shape == (3, 6, 4)
    for j, seg in enumerate(_segments(first)):  # last 4 inputs of each segment, zero-padded in front
        seg_x = head[0, seg]
        expect = torch.cat([seg_x.new_zeros(4, 6), seg_x])[-4:].T
        torch.testing.assert_close(state[j], expect, rtol=0, atol=0)
    out_tail, _ = gk.causal_conv1d(tail, w, b, "silu", initial_state=state, cu_seqlens=_cu(second))
    ref, _ = gk.causal_conv1d(x, w, b, "silu", cu_seqlens=_cu(whole))
    ref_tail = torch.cat([ref[:, s][:, n:] for s, n in zip(_segments(whole), first)], 1)
    torch.testing.assert_close(out_tail, ref_tail, rtol=1e-12, atol=1e-12)


def test_conv_packing_restarts_at_every_segment():
    lengths = [10, 10]
    x, w, b = _conv_inputs(20)
    packed, _ = gk.causal_conv1d(x, w, b, cu_seqlens=_cu(lengths))
    joined, _ = gk.causal_conv1d(x, w, b)
    torch.testing.assert_close(packed[:, :10], joined[:, :10], rtol=0, atol=0)
    assert not torch.allclose(packed[:, 10:13], joined[:, 10:13])  # the taps that would cross
    torch.testing.assert_close(packed[:, 13:], joined[:, 13:], rtol=1e-12, atol=1e-12)


# ---- l2norm -----------------------------------------------------------------------------------------
def test_l2norm_equals_transformers():
    """Also on vectors as short as eps's square root, where eps enters decides the result."""
    hf = _hf()
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64) * torch.logspace(-4, 1, 5, dtype=torch.float64)[:, None, None]
    torch.testing.assert_close(gk.l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gk.l2norm(x.float()), hf.l2norm(x.float(), dim=-1, eps=1e-6), rtol=1e-6, atol=1e-7)
    assert gk.l2norm(x.bfloat16()).dtype == torch.bfloat16


# ---- chunk_gated_delta_rule -------------------------------------------------------------------------
def _rule_inputs(total, batch=1, hk=2, hv=4, dk=16, dv=8, dtype=torch.float64, normed=True, seed=0):
    """q/k with ``hk`` heads, v/g/beta with ``hv``; decays near 1 so the state spans chunks."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, total, hk, dk, generator=g, dtype=dtype) for _ in range(2))
    if normed:
        q, k = gk.l2norm(q), gk.l2norm(k)
    v = torch.randn(batch, total, hv, dv, generator=g, dtype=dtype)
    decay = F.logsigmoid(torch.randn(batch, total, hv, generator=g, dtype=dtype) + 3)
    beta = torch.rand(batch, total, hv, generator=g, dtype=dtype)
    return q, k, v, decay, beta


def _expand(q, k, hv):
    rep = hv // q.shape[2]
    return q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)


def recurrence(q, k, v, g, beta, scale=None, state=None):
    """The gated delta rule token by token (heads already expanded), in the inputs' dtype:
    ``S_t = e^g_t S_{t-1} + k_t (beta_t (v_t - e^g_t S_{t-1}^T k_t))^T`` and ``o_t = S_t^T (scale q_t)``."""
    b, s, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    if state is None:
        state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, scale * q[:, t]))
    return torch.stack(outs, 1), state


def test_recurrence_reference_equals_transformers_recurrent():
    hf = _hf()
    q, k, v, g, beta = _rule_inputs(40, batch=2, dtype=torch.float32)
    q, k = _expand(q, k, 4)
    ours, state = recurrence(q, k, v, g, beta)
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("l2norm_in_kernel", [False, True])
def test_rule_packed_equals_transformers_chunked_per_segment(l2norm_in_kernel):
    """fp32 (transformers computes in fp32 whatever it is given): outputs and every input's gradient."""
    hf = _hf()
    inputs = _rule_inputs(sum(LENGTHS), dtype=torch.float32, normed=not l2norm_in_kernel)
    q, k = _expand(*inputs[:2], 4)
    ours = _leaves(q, k, *inputs[2:])
    out, final = gk.chunk_gated_delta_rule(*ours, use_qk_l2norm_in_kernel=l2norm_in_kernel, cu_seqlens=_cu(LENGTHS))
    assert final is None and out.shape == inputs[2].shape
    theirs = _leaves(q, k, *inputs[2:])
    ref = torch.cat([hf.torch_chunk_gated_delta_rule(*(t[:, seg] for t in theirs),
                                                     use_qk_l2norm_in_kernel=l2norm_in_kernel)[0]
                     for seg in _segments(LENGTHS)], 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    weight = torch.randn_like(out)
    for name, a, r in zip("q k v g beta".split(), _grads(out, ours, weight), _grads(ref, theirs, weight)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_rule_equals_recurrence_fp64_packed_with_states_and_grads():
    """fp64 against the token-by-token recurrence per segment: outputs, final states started from given
    initial states, and gradients wrt q, k, v, g, beta and the initial state; the key heads (2) are
    repeated to the value heads (4) inside the call."""
    lengths = [70, 1, 64, 129]
    q, k, v, g, beta = _rule_inputs(sum(lengths), normed=False, seed=3)
    init = torch.randn(len(lengths), 4, 16, 8, dtype=torch.float64) * 0.1
    ours = _leaves(q, k, v, g, beta, init)
    out, final = gk.chunk_gated_delta_rule(*ours[:5], scale=0.3, initial_state=ours[5], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=_cu(lengths))
    assert final.shape == init.shape and final.dtype == torch.float64
    theirs = _leaves(q, k, v, g, beta, init)
    qn, kn = _expand(gk.l2norm(theirs[0]), gk.l2norm(theirs[1]), 4)
    ref_out, ref_final = [], []
    for j, seg in enumerate(_segments(lengths)):
        o, s = recurrence(qn[:, seg], kn[:, seg], theirs[2][:, seg], theirs[3][:, seg], theirs[4][:, seg],
                          scale=0.3, state=theirs[5][j:j + 1])
        ref_out.append(o)
        ref_final.append(s)
    ref_out, ref_final = torch.cat(ref_out, 1), torch.cat(ref_final, 0)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)
    wo, wf = torch.randn_like(out), torch.randn_like(final)
    ga = torch.autograd.grad((out * wo).sum() + (final * wf).sum(), ours)
    gr = torch.autograd.grad((ref_out * wo).sum() + (ref_final * wf).sum(), theirs)
    for name, a, r in zip("q k v g beta init".split(), ga, gr):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_rule_unpacked_batch_and_bf16():
    """Rows of a batch are independent sequences; bf16 inputs give a bf16 output computed in fp32."""
    q, k, v, g, beta = _rule_inputs(100, batch=3, hk=4, normed=True, seed=5)
    out, final = gk.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    ref, ref_final = recurrence(q, k, v, g, beta)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)
    low = [t.bfloat16() for t in (q, k, v, g, beta)]
    out16, final16 = gk.chunk_gated_delta_rule(*low, output_final_state=True)
    ref16, _ = recurrence(*(t.double() for t in low))
    assert out16.dtype == torch.bfloat16 and final16.dtype == torch.float32
    torch.testing.assert_close(out16.double(), ref16, rtol=2e-2, atol=2e-2)


def test_rule_packing_restarts_the_state():
    q, k, v, g, beta = _rule_inputs(100, hk=4, seed=7)
    packed, _ = gk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu([40, 60]))
    joined, _ = gk.chunk_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(packed[:, :40], joined[:, :40], rtol=1e-12, atol=1e-12)
    alone, _ = recurrence(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:])
    torch.testing.assert_close(packed[:, 40:], alone, rtol=1e-10, atol=1e-10)
    assert (packed[:, 40:] - joined[:, 40:]).abs().max() > 1e-3  # the second segment would see the first


def test_rule_and_conv_refuse_bad_inputs():
    q, k, v, g, beta = _rule_inputs(8, batch=2, hk=4)
    with pytest.raises(ValueError, match="batch 1"):
        gk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu([4, 4]))
    with pytest.raises(ValueError, match="token count"):
        gk.chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=_cu([4, 3]))
    with pytest.raises(ValueError, match="activation"):
        gk.causal_conv1d(torch.randn(1, 4, 3), torch.randn(3, 4), activation="gelu")
    with pytest.raises(NotImplementedError, match="residual"):  # an fla option that would be ignored
        gk.causal_conv1d(torch.randn(1, 4, 3), torch.randn(3, 4), residual=torch.randn(1, 4, 3))


# ---- the same numbers as before issue 53 ----------------------------------------------------------------
#: packed cases: segments of lengths off the 64-token chunk (and on it), an empty one, many of them
BEFORE_CASES = {"four": [130, 7, 64, 1], "nine with an empty one": [61, 0, 200, 5, 128, 33, 64, 1, 90],
                "one": [150], "unpacked rows": None}


@pytest.mark.parametrize("case", BEFORE_CASES)
def test_rule_equals_the_implementation_before_issue_53(case):
    """fp32, against ``tests/gdn_kernels_before.py`` (the kernels as they were: the layout built on the device,
    the scan one chunk at a time): outputs, final states from given initial states, and the gradient of
    q, k, v, g, beta and the initial state."""
    lengths = BEFORE_CASES[case]
    batch, total = (2, 150) if lengths is None else (1, sum(lengths))
    nseg = 1 if lengths is None else len(lengths)
    cu = None if lengths is None else _cu(lengths)
    inputs = _rule_inputs(total, batch=batch, dtype=torch.float32, normed=False, seed=11)
    init = torch.randn(batch * nseg, 4, 16, 8, generator=torch.Generator().manual_seed(2)) * 0.1
    outs, grads = [], []
    for module in (gk, before):
        leaves = _leaves(*inputs, init)
        out, final = module.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        wo = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        wf = torch.randn(final.shape, generator=torch.Generator().manual_seed(5))
        outs.append((out, final))
        grads.append(torch.autograd.grad((out * wo).sum() + (final * wf).sum(), leaves))
    for a, r in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    for name, a, r in zip("q k v g beta init".split(), *grads):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"d{name}: {m}")


def test_conv_equals_the_implementation_before_issue_53():
    """fp32, packed (an empty segment too) with initial and final states: outputs and every gradient."""
    lengths = [5, 0, 70, 3, 64]
    x, w, b = _conv_inputs(sum(lengths), dtype=torch.float32, seed=3)
    init = torch.randn(len(lengths), 6, 4)
    results = []
    for module in (gk, before):
        leaves = _leaves(x, w, b, init)
        out, final = module.causal_conv1d(*leaves[:3], "silu", initial_state=leaves[3], output_final_state=True,
                                          cu_seqlens=_cu(lengths))
        results.append((out, final, *torch.autograd.grad((out * out.detach()).sum() + final.sum(), leaves)))
    for a, r in zip(*results):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


# ---- the norms ----------------------------------------------------------------------------------------
def _zero_centred_before(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def _gated_output_before(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _norms(hidden=24):
    from types import SimpleNamespace

    from mimo_sft.model.norm import GatedOutputRMSNorm, ZeroCenteredRMSNorm

    cfg = SimpleNamespace(normalization="RMSNorm", sequence_parallel=False)
    norms = {"zero-centred": (ZeroCenteredRMSNorm(cfg, hidden, eps=1e-6), _zero_centred_before),
             "gated output": (GatedOutputRMSNorm(cfg, hidden, eps=1e-6), _gated_output_before)}
    with torch.no_grad():
        for norm, _ in norms.values():
            norm.weight.add_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    return norms


@pytest.mark.parametrize("name", ["zero-centred", "gated output"])
def test_norms_equal_their_composites_before_issue_53(name):
    """Each norm is one ``F.rms_norm``: fp32 output and both gradients equal the composite it replaced; a
    bf16 input gives the same bf16 output (the weight applied where it was)."""
    norm, reference = _norms()[name]
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(0)) * 3
    ours, theirs = _leaves(x, norm.weight)
    out = torch.func.functional_call(norm, {"weight": theirs}, (ours,))
    x_ref, w_ref = _leaves(x, norm.weight)
    ref = reference(x_ref, w_ref, norm.eps)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    weight = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * weight).sum(), (ours, theirs)),
                    torch.autograd.grad((ref * weight).sum(), (x_ref, w_ref))):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    low = x.bfloat16()
    torch.testing.assert_close(norm(low), reference(low, norm.weight, norm.eps), rtol=0, atol=0)


def test_each_norm_calls_rms_norm_once_and_normalises_nothing_else():
    """What one ``F.rms_norm`` buys: on CUDA the fused kernel (one kernel, input and rstd kept for backward)."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    for name, (norm, _) in _norms().items():
        with Calls() as calls:
            norm(torch.randn(2, 24))
        assert calls.names.count("rms_norm") == 1 and not {"rsqrt", "pow", "mean"} & set(calls.names), (name, calls.names)


# ---- megatron ---------------------------------------------------------------------------------------
def _gdn_layer(pg_collection, out_norm=None):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            experimental_attention_variant="gated_delta_net", linear_attention_freq=[1],
                            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                            linear_num_key_heads=2, linear_num_value_heads=4, normalization="RMSNorm",
                            activation_func=F.silu)
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=out_norm or WrappedTorchNorm,
                                  out_proj=RowParallelLinear)
    return GatedDeltaNet(cfg, sub, layer_number=1, pg_collection=pg_collection)


def _packed(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_megatron_gated_delta_net_packed_equals_each_segment_alone():
    """megatron's GatedDeltaNet built on the CPU (no fla), thd-packed forward vs one forward per segment,
    and the input gradient of both. torch.compile is switched off for the layer's ``jit_fuser`` helpers
    (megatron wraps them in torch.compile; compiling them on this CPU costs ~40 s and proves nothing)."""
    from mimo_sft.model.gdn_binding import install
    from mimo_sft.parallel.bootstrap import start_single_process

    state = start_single_process("cpu")
    assert install().kernels == "torch"
    layer = _gdn_layer(state.modules["language"].pg_collection)
    assert layer.gated_delta_rule is gk.chunk_gated_delta_rule and layer.conv1d.weight.device.type == "cpu"
    lengths = [70, 1, 5, 66]
    x = torch.randn(sum(lengths), 1, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with torch._dynamo.config.patch(disable=True):
        packed, _ = layer(x, None, packed_seq_params=_packed(_cu(lengths)))
        alone = torch.cat([layer(x[seg], None)[0] for seg in _segments(lengths)], 0)
        joined, _ = layer(x.detach(), None)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    weight = torch.randn_like(packed)
    (g_packed,) = torch.autograd.grad((packed * weight).sum(), x)
    (g_alone,) = torch.autograd.grad((alone * weight).sum(), x)
    torch.testing.assert_close(g_packed, g_alone, rtol=1e-5, atol=1e-6)
    assert (joined[70:] - packed[70:]).abs().max() > 1e-4  # without packing the segments would mix


def test_a_packed_gdn_layer_reads_only_its_host_bounds_once_per_micro_batch():
    """One GDN layer (torch kernels, the gated output norm) forward + backward, twice, then a second layer on
    the same micro-batch, under the host-read counter of ``test_host_syncs``: every read from
    ``gdn_kernels`` or ``norm`` is of the micro-batch's host ``cu_seqlens`` (no device sync on a GPU), one
    per micro-batch; the layouts built from it serve every call after."""
    from test_host_syncs import SyncCounter, _call_site

    from mimo_sft.model.gdn_binding import install
    from mimo_sft.model.norm import GatedOutputRMSNorm
    from mimo_sft.parallel.bootstrap import start_single_process

    class HostReads(SyncCounter):
        """Also says whether each read was of one of ``hosts`` (the micro-batches' ``cu_seqlens``)."""

        def __init__(self, hosts):
            super().__init__()
            self.hosts = hosts

        def _wrap(self, name, original):
            counter = self

            def wrapper(*args, **kwargs):
                inner = getattr(counter._depth, "n", 0)
                if inner == 0 and threading.get_ident() == counter._thread:
                    host = next((f"cu{j}" for j, h in enumerate(counter.hosts) if args and args[0] is h), "other")
                    counter.sites[f"{name}  {_call_site()}  {host}"] += 1
                counter._depth.n = inner + 1
                try:
                    return original(*args, **kwargs)
                finally:
                    counter._depth.n = inner

            return wrapper

    state = start_single_process("cpu")
    install()
    pg = state.modules["language"].pg_collection
    layers = [_gdn_layer(pg, out_norm=GatedOutputRMSNorm) for _ in range(2)]
    micro_batches = [[70, 1, 5, 130], [64, 3, 200]]
    hosts = [_cu(lengths) for lengths in micro_batches]
    with HostReads(hosts) as reads, torch._dynamo.config.patch(disable=True):
        for cu in hosts:
            x = torch.randn(int(cu[-1]), 1, 32, requires_grad=True)
            for layer in (layers[0], layers[0], layers[1]):
                out, _ = layer(x, None, packed_seq_params=_packed(cu))
                out.square().sum().backward()
    ours = {site: n for site, n in reads.sites.items()
            if site.split("  ")[1].startswith(("mimo_sft/model/gdn_kernels.py", "mimo_sft/model/norm.py"))}
    assert sorted(site.rsplit("  ", 1)[1] for site, n in ours.items() for _ in range(n)) == ["cu0", "cu1"], ours
    assert reads.total > 2  # the counter counts: megatron reads the bounds too (host tensors there)


def test_the_test_environment_has_no_fla():
    """fla must not be installed here: megatron and transformers would both switch to it, and the CPU
    runs would test fla's (GPU-only) kernels instead of the stand-ins."""
    import importlib.util

    assert importlib.util.find_spec("fla") is None


def test_the_bench_times_ours_beside_the_kernels_before_on_the_same_work():
    """``scripts/bench_gdn.py --quick --baseline tests/gdn_kernels_before.py``: every case timed on both sides,
    and the sanity column (ours against before) within fp32 / bf16 rounding."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_gdn", root / "scripts" / "bench_gdn.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names, rows = bench.run(bench.QUICK, 1, bench.load_baseline(str(root / "tests" / "gdn_kernels_before.py")),
                            transformers=False)
    assert names == ["ours", "before"] and len(rows) == 2 * len(bench.QUICK["cases"])
    for dtype, _case, t_ours, t_before, diff in rows:
        assert t_ours > 0 and t_before > 0 and diff <= (1e-6 if dtype == "float32" else 1e-2), rows
