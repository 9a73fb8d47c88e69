"""Torch implementations of the three flash-linear-attention kernels megatron-core's GatedDeltaNet calls.

Why this module exists: megatron-core 0.19.2's ``GatedDeltaNet`` (the linear-attention layers of
Qwen3.5 / Qwen3-Next) runs its short convolution, q/k L2 normalisation and chunked gated delta rule
through fla (flash-linear-attention). fla's kernels are triton, so GPU only, and on Hopper GPUs with
triton 3.4.0 to 3.7.0 their gated backward is wrong (``mimo_sft.gdn_path``); where fla is missing
megatron refuses to build the layer (``HAVE_FLA``), and its own torch fallback
(``torch_chunk_gated_delta_rule``, deterministic mode only) refuses ``cu_seqlens``: it cannot train
on packed micro-batches. The CPU runs (tests, CI, export) and those GPUs need both.

Here the three functions keep fla's call signatures (as megatron's ``gdn.py`` calls them) and are
written in plain torch, packed segments included: with ``cu_seqlens`` (one row holding several
samples back to back) the convolution and the recurrent state restart at every segment, so no token
sees another sample. ``model.gdn_binding.install`` binds them where megatron looks them up when the
rule picks them.

No device sync: a packed layout (where each token goes) is built on the host from the segment bounds,
which are read once per ``cu_seqlens`` tensor -- the micro-batch's, which the forward step keeps on
the host and megatron hands unchanged to every layer -- and kept on that tensor with its index
tensors, copied to the device once (pinned, asynchronous). Every layer, and the backward, reuse them.

Numerics: the delta rule is the chunked algorithm (chunks of 64, in fp32, or fp64 for fp64 inputs)
that transformers' ``torch_chunk_gated_delta_rule`` computes. Segments are laid out as whole chunks
(each padded to a multiple of 64) along one flat chunk axis, so every intra-chunk product is a single
batched call for all chunks of all segments. The chunk-to-chunk state recurrence is sequential by
nature (each chunk's state is the previous one's, decayed and updated): it runs one step per chunk
of the longest segment, every segment's chunk of that step in one batch, so a micro-batch of many
samples takes as many steps as its longest sample has chunks, not as all of them together; the
same products as one chunk at a time, so the same numbers. The convolution lays segments out with
``width - 1`` zero (or initial-state) slots in front of each and adds the ``width`` shifted,
weighted copies: channels stay the fast axis, no ``[b, d, s]`` transpose.
"""

from __future__ import annotations

from itertools import accumulate
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from mimo_sft.model.segments import host_to

CHUNK = 64
#: the attribute of a ``cu_seqlens`` tensor that keeps its bounds and layouts (one micro-batch's)
_CACHE = "_mimo_gdn"


# ---- the packed layout, from host bounds, once per micro-batch ----------------------------------------
def _compute_dtype(*tensors) -> torch.dtype:
    """fp64 when any input is fp64 (the tests' tight references), else fp32 (fla accumulates in fp32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _segment_bounds(cu_seqlens: Optional[torch.Tensor], batch: int, total: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the segments along the token axis; unpacked rows are one segment each.

    The bounds are read once per ``cu_seqlens`` tensor and kept on it: every GDN layer of a forward (and
    the convolution and the rule of each) gets the same tensor, the micro-batch's. The forward step keeps
    it on the host (``train.packing``), so that one read is no device sync; a device tensor costs one."""
    if cu_seqlens is None:
        return [(0, total)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs the packed tokens in one row (batch 1), got batch {batch}")
    cache = _cache_of(cu_seqlens)
    if "bounds" not in cache:
        cu = [int(c) for c in cu_seqlens.tolist()]
        if len(cu) < 2 or cu[0] != 0 or any(e < s for s, e in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to the token count, got {cu}")
        cache["bounds"] = list(zip(cu[:-1], cu[1:]))
    bounds = cache["bounds"]
    if bounds[-1][1] != total:
        raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got one ending at {bounds[-1][1]}")
    return bounds


def _cache_of(cu_seqlens: torch.Tensor) -> dict:
    """The per-micro-batch cache kept on its ``cu_seqlens`` tensor (bounds, device layouts, device copies)."""
    cache = getattr(cu_seqlens, _CACHE, None)
    if cache is None:
        cache = {}
        setattr(cu_seqlens, _CACHE, cache)
    return cache


def _cached(cu_seqlens: torch.Tensor, key: tuple, build):
    cache = _cache_of(cu_seqlens)
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _positions(bounds, lead: int, multiple: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Host arithmetic: each segment's span (``lead`` prefix slots + its tokens, up to a multiple of
    ``multiple``), each token's slot in the laid-out row and each prefix slot's, segment by segment."""
    lengths = [e - s for s, e in bounds]
    spans = [(n + lead + multiple - 1) // multiple * multiple for n in lengths]
    first = [0, *accumulate(spans)][:-1]  # where each segment's slots begin
    shift = torch.tensor([f + lead - s for f, (s, _) in zip(first, bounds)], dtype=torch.long)
    token_pos = shift.repeat_interleave(torch.tensor(lengths, dtype=torch.long)) + torch.arange(sum(lengths))
    prefix_pos = (torch.tensor(first, dtype=torch.long)[:, None] + torch.arange(lead)).reshape(-1)
    return spans, token_pos, prefix_pos


class _ConvLayout:
    """Where each input of a packed convolution goes: ``index`` gathers ``[tokens; prefix slots]`` into the
    laid-out row (every segment after its ``width - 1`` prefix inputs), ``window_start`` picks each
    token's output from the valid convolution of that row. Built on the host, copied once."""

    def __init__(self, bounds, lead: int, device):
        spans, token_pos, prefix_pos = _positions(bounds, lead, 1)
        total = token_pos.numel()
        index = torch.empty(sum(spans), dtype=torch.long)
        index[token_pos] = torch.arange(total)
        index[prefix_pos] = total + torch.arange(prefix_pos.numel())
        self.index = host_to(index, device)
        self.window_start = host_to(token_pos - lead, device)


class _RuleLayout:
    """The chunked rule's layout of packed segments (see the module docstring): tokens at ``token_pos`` in
    a row of ``size`` slots (every segment from a chunk start, padded to whole chunks), and the scan's
    plan: segments longest first, the chunks of scan step ``t`` (the ``t``-th chunk of every segment that
    has one) contiguous after ``perm``, ``sizes[t]`` of them; ``inverse`` undoes ``perm``; ``order`` /
    ``unorder`` sort the segments' states and put them back. Built on the host, copied once."""

    def __init__(self, bounds, device):
        spans, token_pos, _ = _positions(bounds, 0, CHUNK)
        self.size = sum(spans)
        self.token_pos = host_to(token_pos, device)
        chunks = [s // CHUNK for s in spans]
        first = [0, *accumulate(chunks)][:-1]
        order = sorted(range(len(chunks)), key=lambda j: -chunks[j])
        self.sizes = [sum(1 for j in order if chunks[j] > t) for t in range(max(chunks, default=0))]
        perm = [first[j] + t for t, n in enumerate(self.sizes) for j in order[:n]]
        host_perm = torch.tensor(perm, dtype=torch.long)
        identity = perm == list(range(len(perm)))
        self.perm = None if identity else host_to(host_perm, device)
        self.inverse = None if identity else host_to(torch.argsort(host_perm), device)
        self.order = host_to(torch.tensor(order, dtype=torch.long), device)
        self.unorder = host_to(torch.argsort(torch.tensor(order, dtype=torch.long)), device)


def _unpacked_rule_layout(total: int) -> SimpleNamespace:
    """One segment per row: chunks in order (no index), the row padded at its end."""
    size = (total + CHUNK - 1) // CHUNK * CHUNK
    return SimpleNamespace(size=size, token_pos=None, sizes=[1] * (size // CHUNK), perm=None, inverse=None,
                           order=None, unorder=None)


# ---- causal_conv1d ----------------------------------------------------------------------------------
def _conv_prefix(initial_state, batch: int, nseg: int, dim: int, width: int, dtype, device) -> torch.Tensor:
    """The ``width`` inputs before each segment, ``[b, nseg, width, d]`` (fla's ``[N, d, width]`` state)."""
    if initial_state is None:
        return torch.zeros(batch, nseg, width, dim, dtype=dtype, device=device)
    if tuple(initial_state.shape) != (batch * nseg, dim, width):
        raise ValueError(f"initial_state must be [{batch * nseg}, {dim}, {width}], got {tuple(initial_state.shape)}")
    return initial_state.to(dtype).reshape(batch, nseg, dim, width).transpose(2, 3)


def _refuse_extras(fn: str, kwargs: dict) -> None:
    """fla's functions take more options than megatron passes; one set here would be silently ignored,
    so it fails instead (``cu_seqlens_cpu`` only repeats ``cu_seqlens`` and is ignored)."""
    used = sorted(k for k, v in kwargs.items() if k != "cu_seqlens_cpu" and v is not None and v is not False)
    if used:
        raise NotImplementedError(f"{fn}: the torch kernel does not implement {', '.join(used)}")


def _laid_out_inputs(xs, prefix, bounds, cu_seqlens) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``[b, size, d]``: every segment after its ``width - 1`` prefix inputs; and the window start of
    each token (its output's position in the valid convolution)."""
    batch, total, dim = xs.shape
    lead = prefix.shape[2] - 1
    if len(bounds) == 1:  # one segment per row: the prefix goes in front, outputs are in token order
        return torch.cat([prefix[:, 0, 1:], xs], dim=1), None
    layout = _cached(cu_seqlens, ("conv", lead, xs.device), lambda: _ConvLayout(bounds, lead, xs.device))
    src = torch.cat([xs, prefix[:, :, 1:].reshape(batch, -1, dim)], dim=1)
    return src.index_select(1, layout.index), layout.window_start
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
    """Depthwise causal convolution in fla's layout: ``x [b, s, d]``, ``weight [d, width]`` -> ``(y [b, s, d], state)``.

    ``y[t] = act(bias + sum_j weight[:, j] * x[t - width + 1 + j])``, inputs before a segment's start
    being zero (or ``initial_state [N, d, width]``, oldest first, one per segment). With ``cu_seqlens``
    (batch 1) every segment restarts. ``state`` (``output_final_state``) is each segment's last
    ``width`` inputs, ``[N, d, width]``. Accumulates in fp32 (fp64 for fp64 inputs); ``y`` has x's dtype.
    """
    _refuse_extras("causal_conv1d", kwargs)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d activation must be None, 'silu' or 'swish', got {activation!r}")
    batch, total, dim = x.shape
    width = weight.shape[-1]
    if tuple(weight.shape) != (dim, width):
        raise ValueError(f"causal_conv1d weight must be [{dim}, width], got {tuple(weight.shape)}")
    bounds = _segment_bounds(cu_seqlens, batch, total)
    dtype = _compute_dtype(x, weight)
    xs = x.to(dtype)
    prefix = _conv_prefix(initial_state, batch, len(bounds), dim, width, dtype, x.device)
    laid, window_start = _laid_out_inputs(xs, prefix, bounds, cu_seqlens)
    w = weight.to(dtype)
    n_out = laid.shape[1] - (width - 1)
    y = laid[:, :n_out] * w[:, 0]
    for j in range(1, width):
        y = torch.addcmul(y, laid[:, j:j + n_out], w[:, j])
    if window_start is not None:
        y = y.index_select(1, window_start)
    if bias is not None:
        y = y + bias.to(dtype)
    if activation is not None:
        y = F.silu(y)
    final = None
    if output_final_state:
        rows = [torch.cat([prefix[:, j], xs[:, s:e]], dim=1)[:, -width:] for j, (s, e) in enumerate(bounds)]
        final = torch.stack(rows, 1).reshape(-1, width, dim).transpose(1, 2).to(x.dtype)
    return y.to(x.dtype), final


# ---- l2norm -----------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: Optional[torch.dtype] = None):
    """``x / sqrt(sum(x * x) + eps)`` along ``dim``, in fp32 (fp64 for fp64 x) as fla computes it."""
    xs = x.to(_compute_dtype(x))
    y = xs * torch.rsqrt((xs * xs).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


# ---- chunk_gated_delta_rule -------------------------------------------------------------------------
def _check_rule_shapes(q, k, v, g, beta) -> None:
    b, s, hk, _ = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, s) or g.shape != (b, s, hv) or beta.shape != (b, s, hv):
        raise ValueError(f"chunk_gated_delta_rule shapes: q/k [b, s, h, dk], v [b, s, hv, dv], g/beta [b, s, hv]; "
                         f"got q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of the query/key heads ({hk})")


def _to_chunks(t: torch.Tensor, layout) -> torch.Tensor:
    """``[b, T, h, *rest]`` -> ``[b, h, C, 64, *rest]``: tokens at their laid-out slots, zeros between."""
    tt = t.transpose(1, 2)
    if layout.token_pos is None:  # one segment per row: zeros after its end
        pad = tt.new_zeros(tt.shape[:2] + (layout.size - tt.shape[2],) + tt.shape[3:])
        out = torch.cat([tt, pad], dim=2)
    else:
        out = tt.new_zeros(tt.shape[:2] + (layout.size,) + tt.shape[3:]).index_copy(2, layout.token_pos, tt)
    return out.view(out.shape[:2] + (layout.size // CHUNK, CHUNK) + out.shape[3:])


def _intra_chunk(q, k, v, g, beta):
    """Everything that is independent per chunk, for all chunks at once (inputs ``[b, h, C, 64, ...]``).

    Returns the UT-transformed values ``u`` and decayed keys ``w`` (``(I + A) [u, w] = [beta v, beta k e^G]``
    with ``A`` the strictly lower, decayed ``beta_i k_i . k_j``), the decayed causal ``q . k`` scores, the
    decayed queries/keys that read/write the state and each chunk's total decay.
    """
    cum = g.cumsum(-1)  # G: log decay from the chunk start to each position
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_read = q * cum.exp()[..., None]
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]
    return u, w, scores, q_read, k_write, cum[..., -1].exp()[..., None, None]


def _scan(u, w, k_write, chunk_decay, layout, init: torch.Tensor):
    """The state recurrence over chunks, every segment at once, restarting at every segment's first chunk.

    ``init``: each segment's start state ``[b, h, N, dk, dv]``. Step ``t`` advances the ``t``-th chunk of
    every segment that has one, as one batch: the segments are sorted longest first, so those still
    running are a prefix and a finished one leaves with its final state; the chunks were permuted so
    that each step's are contiguous, and are split once (per-step views whose backward is one
    concatenation; indexing per step would make autograd sum one full-size gradient per step). Steps:
    the longest segment's chunk count, not all chunks. Returns the state entering every chunk
    ``[b, h, C, dk, dv]``, every chunk's corrected values ``v - w S`` ``[b, h, C, 64, dv]`` (both in
    chunk order) and the final states ``[b, h, N, dk, dv]``.
    """
    k_write = k_write.transpose(-1, -2)
    operands = (u, w, k_write, chunk_decay)
    if layout.perm is not None:
        operands = (t.index_select(2, layout.perm) for t in operands)
    steps = zip(*(t.split(layout.sizes, dim=2) for t in operands))
    state = init if layout.order is None else init.index_select(2, layout.order)
    states, values, finished = [], [], []
    for (u_t, w_t, k_t, decay_t), running in zip(steps, layout.sizes):
        if running < state.shape[2]:
            finished.append(state[:, :, running:])
            state = state[:, :, :running]
        states.append(state)
        v_new = u_t - w_t @ state
        values.append(v_new)
        state = state * decay_t + k_t @ v_new
    finished.append(state)
    final = torch.cat(finished[::-1], dim=2)
    states, values = torch.cat(states, dim=2), torch.cat(values, dim=2)
    if layout.inverse is not None:
        states, values = states.index_select(2, layout.inverse), values.index_select(2, layout.inverse)
    if layout.unorder is not None:
        final = final.index_select(2, layout.unorder)
    return states, values, final


def _initial_states(initial_state, batch, nseg, heads, dk, dv, dtype, device) -> torch.Tensor:
    """Each segment's start state ``[b, h, N, dk, dv]`` (fla's ``[N * b, h, dk, dv]``, segments inner)."""
    if initial_state is None:
        return torch.zeros(batch, heads, nseg, dk, dv, dtype=dtype, device=device)
    if tuple(initial_state.shape) != (batch * nseg, heads, dk, dv):
        raise ValueError(f"initial_state must be [{batch * nseg}, {heads}, {dk}, {dv}], "
                         f"got {tuple(initial_state.shape)}")
    return initial_state.to(dtype).reshape(batch, nseg, heads, dk, dv).transpose(1, 2)


def _rule_layout(cu_seqlens, bounds, total: int, device):
    if cu_seqlens is None:
        return _unpacked_rule_layout(total)
    return _cached(cu_seqlens, ("rule", device), lambda: _RuleLayout(bounds, device))


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
    """The gated delta rule in fla's layout -> ``(o [b, s, hv, dv], final state [N, hv, dk, dv] or None)``.

    ``q/k [b, s, h, dk]`` (h divides hv; heads are repeated to hv), ``v [b, s, hv, dv]``, ``g [b, s, hv]``
    (log decay, <= 0), ``beta [b, s, hv]``. Per token: ``S = e^g S``, ``S += k (beta (v - S^T k))^T``,
    ``o = S^T (scale q)``; ``scale`` defaults to ``dk ** -0.5``. With ``cu_seqlens`` (batch 1) the state
    restarts at every segment (from zero, or that segment's ``initial_state``). ``o`` has v's dtype; the
    final state is fp32 (fp64 for fp64 inputs).
    """
    _refuse_extras("chunk_gated_delta_rule", kwargs)
    _check_rule_shapes(q, k, v, g, beta)
    batch, total, hk, dk = q.shape
    hv, dv = v.shape[2:]
    bounds = _segment_bounds(cu_seqlens, batch, total)
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta), v.dtype
    if hk != hv:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    init = _initial_states(initial_state, batch, len(bounds), hv, dk, dv, dtype, q.device)
    layout = _rule_layout(cu_seqlens, bounds, total, q.device)
    if layout.size == 0:
        out, final = v.new_zeros(batch, 0, hv, dv), init  # no tokens at all
    else:
        qc, kc, vc, gc, bc = (_to_chunks(t, layout) for t in (q, k, v, g, beta))
        u, w, scores, q_read, k_write, chunk_decay = _intra_chunk(qc, kc, vc, gc, bc)
        states, values, final = _scan(u, w, k_write, chunk_decay, layout, init)
        o = (q_read @ states + scores @ values).reshape(batch, hv, layout.size, dv)  # [b, h, C * 64, dv]
        o = o[:, :, :total] if layout.token_pos is None else o.index_select(2, layout.token_pos)
        out = o.transpose(1, 2)
    final = final.transpose(1, 2).reshape(-1, hv, dk, dv) if output_final_state else None
    return out.to(out_dtype).contiguous(), final
