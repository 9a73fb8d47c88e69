"""Forward matmul FLOPs of each family's vision tower (pure arithmetic on its transformers vision config).

One function per tower, named by its family's descriptor (``FamilySpec.vision_flops``) and called by
``train.flops.vision_forward_flops`` with the ``(t, h, w)`` patch grids of the encoded images; the
conventions are ``train.flops``'s (matmuls only, ``2*m*n*k``; norms, activations, rotary, the learned
position-embedding interpolation and bias adds not counted). Checked against torch's
``FlopCounterMode`` on transformers' own modules (``tests/test_flops.py``, ``tests/test_qwen3_vl.py``).
"""

from __future__ import annotations


def _block_sizes(n: int, block: int) -> list[int]:
    """Sizes of consecutive blocks of ``block`` covering ``n`` (the last one may be smaller)."""
    full, rest = divmod(n, block)
    return [block] * full + ([rest] if rest else [])


def windowed_attention_pairs(vision_config, grids) -> tuple[int, int]:
    """Qwen2.5-VL: ``(sum over full-attention segments of n^2, sum over windows of n^2)`` in patches.

    Full attention: one segment per frame of ``h*w`` patches. Windows: the merged-token grid
    ``(h/m, w/m)`` is cut into squares of ``window_size // m // patch_size`` merged tokens from the
    top-left (edge windows smaller); a window of ``a x b`` merged tokens holds ``a*b*m^2`` patches.
    """
    v = vision_config
    m = v.spatial_merge_size
    win = v.window_size // m // v.patch_size
    if win < 1:
        raise ValueError(f"window_size {v.window_size} is smaller than one merged token ({m} x {v.patch_size} pixels)")
    full = windowed = 0
    for t, h, w in grids:
        full += t * (h * w) ** 2
        rows = sum(a * a for a in _block_sizes(h // m, win))
        cols = sum(b * b for b in _block_sizes(w // m, win))
        windowed += t * rows * cols * m ** 4
    return full, windowed


def _merger_flops(merged: int, ctx: int, out: int) -> int:
    """One patch merger: ``linear_fc1`` (ctx -> ctx) and ``linear_fc2`` (ctx -> out) on the merged tokens."""
    return 2 * merged * ctx * ctx + 2 * merged * ctx * out


def _tower_terms(v, grids, *, mlp_matrices: int) -> tuple[int, int, int]:
    """``(N patches, patch embedding + every block's linear layers, one patch merger)`` in FLOPs.

    What both towers compute alike: the embedding conv ``2*N*d*(C*tp*p*p)``, per block QKV
    ``2*N*d*3d``, output projection ``2*N*d*d`` and an MLP of ``mlp_matrices`` ``d x ffn`` matrices
    (gated 3, plain 2), and mergers of the same shape; each family adds its own attention.
    """
    n = sum(t * h * w for t, h, w in grids)
    d, ffn, m = v.hidden_size, v.intermediate_size, v.spatial_merge_size
    patch_in = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    embed = 2 * n * d * patch_in
    per_block_linear = n * (2 * d * 3 * d + 2 * d * d + 2 * mlp_matrices * d * ffn)
    merger = _merger_flops(n // (m * m), d * m * m, v.out_hidden_size)
    return n, embed + v.depth * per_block_linear, merger


def qwen2_5_vl(vision_config, grids) -> float:
    """Qwen2.5-VL's tower + patch merger.

    Patch embedding (a conv whose kernel covers a whole patch) ``2*N*d*(C*tp*p*p)``; per block
    QKV ``2*N*d*3d``, output projection ``2*N*d*d``, gated MLP ``3*2*N*d*ffn`` and attention
    ``2*2*d*sum(n^2)`` over its segments (frames for ``fullatt_block_indexes``, windows otherwise:
    :func:`windowed_attention_pairs`); merger ``2*N/m^2*(d m^2)^2 + 2*N/m^2*(d m^2)*out``.
    """
    v = vision_config
    n, linear, merger = _tower_terms(v, grids, mlp_matrices=3)
    if n == 0:
        return 0.0
    full_blocks = sum(1 for i in set(v.fullatt_block_indexes or ()) if 0 <= i < v.depth)
    window_blocks = v.depth - full_blocks
    full_sq, window_sq = windowed_attention_pairs(v, grids)
    attention = 2 * 2 * v.hidden_size * (full_blocks * full_sq + window_blocks * window_sq)
    return float(linear + attention + merger)


def qwen3_vl(vision_config, grids) -> float:
    """Qwen3-VL's tower, main merger and DeepStack mergers (also Qwen3.5's tower, whose config has no
    ``deepstack_visual_indexes``: no DeepStack mergers).

    Patch embedding ``2*N*d*(C*tp*p*p)``; per block QKV ``2*N*d*3d``, output ``2*N*d*d``, plain MLP
    (``linear_fc1``/``linear_fc2``) ``2*2*N*d*ffn`` and full attention within each frame
    ``2*2*d*t*(h*w)^2``; then ``1 + len(deepstack_visual_indexes)`` mergers of the same shape, each
    ``2*N/m^2*(d m^2)^2 + 2*N/m^2*(d m^2)*out`` (the DeepStack mergers normalise after the shuffle,
    which changes no matmul).
    """
    v = vision_config
    n, linear, merger = _tower_terms(v, grids, mlp_matrices=2)
    if n == 0:
        return 0.0
    full_sq = sum(t * (h * w) ** 2 for t, h, w in grids)
    attention = 2 * 2 * v.hidden_size * v.depth * full_sq
    deepstack = len(getattr(v, "deepstack_visual_indexes", None) or ())
    return float(linear + attention + (1 + deepstack) * merger)
