"""Torch stand-ins for the three flash-linear-attention kernels megatron-core's GatedDeltaNet calls.

Why this module exists: megatron-core 0.19.2's ``GatedDeltaNet`` (the linear-attention layers of
Qwen3.5 / Qwen3-Next) runs its short convolution, q/k L2 normalisation and chunked gated delta rule
through fla (flash-linear-attention). fla's kernels are triton, so GPU only; where fla is missing
megatron refuses to build the layer (``HAVE_FLA``), and its own torch fallback
(``torch_chunk_gated_delta_rule``, deterministic mode only) refuses ``cu_seqlens``: it cannot train
on packed micro-batches. The CPU runs (tests, CI, export) need both.

Here the three functions keep fla's call signatures (as megatron's ``gdn.py`` calls them) and are
written in plain torch, packed segments included: with ``cu_seqlens`` (one row holding several
samples back to back) the convolution and the recurrent state restart at every segment, so no token
sees another sample. :func:`install` binds them where megatron looks them up, and only where fla is
absent: a GPU machine with fla installed keeps fla's kernels.

Numerics: the delta rule is the chunked algorithm (chunks of 64, in fp32, or fp64 for fp64 inputs)
that transformers' ``torch_chunk_gated_delta_rule`` computes. Segments are laid out as whole chunks
(each padded to a multiple of 64) along one flat chunk axis, so every intra-chunk product is a single
batched call for all segments and only the chunk-to-chunk state scan is a python loop. The
convolution lays segments out with ``width - 1`` zero (or initial-state) slots in front of each and
adds the ``width`` shifted, weighted copies: channels stay the fast axis, no ``[b, d, s]`` transpose.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional

import torch
import torch.nn.functional as F

CHUNK = 64
_MEGATRON_MODULES = ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net.gdn",
                     "megatron.core.ssm.gated_delta_net")


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


# ---- binding into megatron --------------------------------------------------------------------------
def install() -> bool:
    """Bind the three functions where megatron's GatedDeltaNet looks them up, when fla is absent (idempotent).

    ``gated_delta_net.common`` imported fla's functions (or ``None``) into its globals and set
    ``HAVE_FLA``, which the layer's constructor checks; ``gdn`` copied ``causal_conv1d`` and
    ``chunk_gated_delta_rule`` from it at import, and the package ``__init__`` re-exports all four. Every
    one of those names that exists is rebound. Call before building a model: the constructor picks
    ``chunk_gated_delta_rule`` when it runs. Returns True when these stand-ins are in use, False when
    megatron found fla (the GPU path, left untouched).
    """
    import mimo_sft.parallel  # noqa: F401  (makes megatron importable without triton)

    _install_cp_permutation()
    common = importlib.import_module(_MEGATRON_MODULES[0])
    if common.chunk_gated_delta_rule is chunk_gated_delta_rule:
        return True
    if common.HAVE_FLA:
        return False
    ours = {"causal_conv1d": causal_conv1d, "l2norm": l2norm, "chunk_gated_delta_rule": chunk_gated_delta_rule,
            "HAVE_FLA": True}
    for name in _MEGATRON_MODULES:
        module = importlib.import_module(name)
        for attr, value in ours.items():
            if attr in vars(module):
                setattr(module, attr, value)
    _run_helpers_eagerly()
    return True


def _install_cp_permutation() -> None:
    """Under context parallelism (``model.context_parallel``) megatron's GatedDeltaNet builds its sequence
    permutation from ``cu_seqlens`` (``_build_thd_cp_a2a_perm``) in every layer and indexes its activations with
    it. The forward step keeps ``cu_seqlens`` on the host (megatron's THD rotary reads them there), so the
    permutation would be a host index into device activations (an error on a GPU). Bound on every device, fla or
    not: the same function, its result copied to the process's device once per ``cu_seqlens`` tensor (one
    forward) and shared by every GDN layer."""
    gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    original = gdn._build_thd_cp_a2a_perm
    if getattr(original, "_mimo_on_device", False):
        return

    def on_device(cu_seqlens, cp_size, t_global):
        from mimo_sft.parallel import runtime

        cache = cu_seqlens.__dict__.setdefault("_mimo_cp_perm", {})
        if (cp_size, t_global) not in cache:
            cache[(cp_size, t_global)] = tuple(runtime.host_to(t, runtime.device())
                                               for t in original(cu_seqlens, cp_size, t_global))
        return cache[(cp_size, t_global)]

    on_device._mimo_on_device = True
    gdn._build_thd_cp_a2a_perm = on_device


#: megatron's ``jit_fuser`` (``torch.compile``) helpers on Qwen3.5's path: ``(module, class, method)``
_COMPILED_HELPERS = (("megatron.core.ssm.gated_delta_net.common", "_GDNBase", "_prepare_input_for_gated_delta_rule"),
                     ("megatron.core.ssm.gated_delta_net.common", "_GDNBase", "_compute_g_and_beta"),
                     ("megatron.core.ssm.gated_delta_net.common", "_GDNBase", "_apply_gated_norm"),
                     ("megatron.core.transformer.attention", "Attention", "_apply_output_gate"))
_COMPILED: dict = {}


def _run_helpers_eagerly() -> None:
    """On the stand-ins' path, megatron's compiled helpers run as plain functions.

    Why: inductor compiles them on the CPU in ~12 s per process and again for each new sequence
    length until shapes go dynamic (measured: 11 s and 10 s for the first two lengths of a tiny model,
    against 0.3 s eager), every rank of every CPU run; the numbers are the same functions'. A GPU run
    with fla keeps megatron's compiled ones (what the memory forecast counts: :func:`compiled_helpers`)."""
    for module, cls, name in _COMPILED_HELPERS:
        owner = getattr(importlib.import_module(module), cls)
        fn = owner.__dict__[name]
        original = getattr(fn, "_torchdynamo_orig_callable", None)
        if original is not None:
            _COMPILED[(module, cls, name)] = fn
            setattr(owner, name, original)


@contextlib.contextmanager
def compiled_helpers():
    """megatron's compiled helpers back for the duration (``testing.saved_bytes``: what a GPU run keeps)."""
    owners = {key: getattr(importlib.import_module(key[0]), key[1]) for key in _COMPILED}
    eager = {key: owner.__dict__[key[2]] for key, owner in owners.items()}
    for key, owner in owners.items():
        setattr(owner, key[2], _COMPILED[key])
    try:
        yield
    finally:
        for key, owner in owners.items():
            setattr(owner, key[2], eager[key])
