"""``model.gdn_kernels`` as it was at commit b4e99e6, before issue 53 (the reference of ``test_gdn_kernels``).

Kept verbatim but for this docstring and the megatron binding (dropped): its layout was built on the
kernels' device with host reads of it, its chunk scan ran one chunk at a time, segment after segment.
The current kernels must give the same numbers (fp32, forward and backward).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

CHUNK = 64


# ---- shared layout helpers --------------------------------------------------------------------------
def _compute_dtype(*tensors) -> torch.dtype:
    """fp64 when any input is fp64 (the tests' tight references), else fp32 (fla accumulates in fp32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _segment_bounds(cu_seqlens: Optional[torch.Tensor], batch: int, total: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the segments along the token axis; unpacked rows are one segment each."""
    if cu_seqlens is None:
        return [(0, total)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs the packed tokens in one row (batch 1), got batch {batch}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(e < s for s, e in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got {cu}")
    return list(zip(cu[:-1], cu[1:]))


def _layout(bounds, lead: int, multiple: int, device) -> tuple[int, torch.Tensor, torch.Tensor, list[int]]:
    """Segments back to back, each after ``lead`` prefix slots and padded up to a multiple of ``multiple``.

    Returns the laid-out length, each token's position in it, each prefix slot's position (segment by
    segment) and each segment's span.
    """
    lengths = torch.tensor([e - s for s, e in bounds], dtype=torch.long, device=device)
    spans = (lengths + lead + multiple - 1) // multiple * multiple
    first = torch.cumsum(spans, 0) - spans  # where each segment's slots begin
    seg = torch.repeat_interleave(torch.arange(len(bounds), device=device), lengths)
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.long, device=device)
    token = torch.arange(int(lengths.sum()), device=device)
    token_pos = first[seg] + lead + (token - starts[seg])
    prefix_pos = (first[:, None] + torch.arange(lead, device=device)).reshape(-1)
    return int(spans.sum()), token_pos, prefix_pos, spans.tolist()


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
        raise NotImplementedError(f"{fn}: the CPU stand-in does not implement {', '.join(used)}")


def _laid_out_inputs(xs, prefix, bounds) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``[b, size, d]``: every segment after its ``width - 1`` prefix inputs; and the window start of
    each token (its output's position in the valid convolution)."""
    batch, total, dim = xs.shape
    lead = prefix.shape[2] - 1
    if len(bounds) == 1:  # one segment per row: the prefix goes in front, outputs are in token order
        return torch.cat([prefix[:, 0, 1:], xs], dim=1), None
    size, token_pos, prefix_pos, _ = _layout(bounds, lead, 1, xs.device)
    src = torch.cat([xs, prefix[:, :, 1:].reshape(batch, -1, dim)], dim=1)
    index = torch.empty(size, dtype=torch.long, device=xs.device)
    index[token_pos] = torch.arange(total, device=xs.device)
    index[prefix_pos] = total + torch.arange(prefix_pos.numel(), device=xs.device)
    return src.index_select(1, index), token_pos - lead


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
    laid, window_start = _laid_out_inputs(xs, prefix, bounds)
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


def _to_chunks(t: torch.Tensor, size: int, token_pos: torch.Tensor) -> torch.Tensor:
    """``[b, T, h, *rest]`` -> ``[b, h, C, 64, *rest]``: tokens at their laid-out positions, zeros between."""
    tt = t.transpose(1, 2)
    out = tt.new_zeros(tt.shape[:2] + (size,) + tt.shape[3:]).index_copy(2, token_pos, tt)
    return out.view(out.shape[:2] + (size // CHUNK, CHUNK) + out.shape[3:])


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


def _scan(u, w, k_write, chunk_decay, spans: list[int], init: list[torch.Tensor]):
    """The state recurrence over chunks, restarting at every segment's first chunk.

    Returns the state entering every chunk ``[b, h, C, dk, dv]``, every chunk's corrected values
    ``v - w S`` ``[b, h, C, 64, dv]`` and each segment's final state. The per-chunk operands are split
    once (``unbind``): indexing the full tensors per chunk would make autograd build and sum one
    full-size gradient per chunk, quadratic in the sequence length.
    """
    u, w, k_write, chunk_decay = (t.unbind(2) for t in (u, w, k_write.transpose(-1, -2), chunk_decay))
    states, values, finals, c = [], [], [], 0
    for j, span in enumerate(spans):
        state = init[j]
        for _ in range(span // CHUNK):
            states.append(state)
            v_new = u[c] - w[c] @ state
            values.append(v_new)
            state = state * chunk_decay[c] + k_write[c] @ v_new
            c += 1
        finals.append(state)
    return torch.stack(states, 2), torch.stack(values, 2), finals


def _initial_states(initial_state, batch, nseg, heads, dk, dv, dtype, device) -> list[torch.Tensor]:
    """One ``[b, h, dk, dv]`` start state per segment (fla's ``[N, h, dk, dv]``, N = b * segments)."""
    if initial_state is None:
        zero = torch.zeros(batch, heads, dk, dv, dtype=dtype, device=device)
        return [zero] * nseg
    if tuple(initial_state.shape) != (batch * nseg, heads, dk, dv):
        raise ValueError(f"initial_state must be [{batch * nseg}, {heads}, {dk}, {dv}], "
                         f"got {tuple(initial_state.shape)}")
    rows = initial_state.to(dtype).reshape(batch, nseg, heads, dk, dv)
    return list(rows.unbind(1))


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
    size, token_pos, _, spans = _layout(bounds, 0, CHUNK, q.device)
    if size == 0:
        out = v.new_zeros(batch, 0, hv, dv)  # no tokens at all
    else:
        qc, kc, vc, gc, bc = (_to_chunks(t, size, token_pos) for t in (q, k, v, g, beta))
        u, w, scores, q_read, k_write, chunk_decay = _intra_chunk(qc, kc, vc, gc, bc)
        states, values, init = _scan(u, w, k_write, chunk_decay, spans, init)  # init: now the final states
        o = q_read @ states + scores @ values  # [b, h, C, 64, dv]
        out = o.reshape(batch, hv, size, dv).index_select(2, token_pos).transpose(1, 2)
    final = torch.stack(init, 1).reshape(-1, hv, dk, dv) if output_final_state else None
    return out.to(out_dtype).contiguous(), final
