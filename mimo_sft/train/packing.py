"""In-batch packing: a language rank's micro-batch as one padding-free sequence (THD).

The data layer, the reorder exchange and the colocated bridge all move padded rows ``[B, S]``
(exchanged samples must share one width). Packing happens last, in the forward step, on the rows
this language rank is about to compute: the real tokens of every sample are laid back to back into
``[1, T]`` (``T = sum of real lengths``), and ``cu_seqlens`` marks where each sample starts, which
megatron's MIMO packing path (``MimoModel.forward(packing_kwargs=...)`` -> ``PackedSeqParams``,
``qkv_format="thd"``) hands to every attention layer and to rotary embedding.

What keeps a packed step exactly equal to the padded one:

* rows are right-padded (``attention_mask`` is a prefix of ones), so dropping the pads keeps each
  sample's tokens, labels and loss mask in order, and image placeholders stay in the order the
  encoder emits its embeddings (MimoModel scatters them by position in the flattened ids);
* mRoPE positions travel with the tokens (``position_ids [3, 1, T]``): each sample keeps its own
  three-row positions, and megatron's THD rotary path indexes them by packed offset;
* the attention core (``model.attention.SDPAttention``) runs causal attention per ``cu_seqlens``
  segment, so no token attends across samples;
* labels are already shifted per sample, so nothing is re-shifted across sample boundaries.

Pure tensor code, host side (before the copy to the device): no megatron, no torch.distributed.
"""

from __future__ import annotations

import torch

#: the micro-batch fields that describe language positions and are packed (the rest pass through)
PACKED_KEYS = ("input_ids", "labels", "loss_mask")


def real_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row real lengths of a right-padded ``[B, S]`` mask (AssertionError if a row is not a prefix)."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    assert torch.equal(mask, prefix), "in-batch packing needs right-padded rows (attention_mask a prefix of ones)"
    return lengths


def pack_micro_batch(batch: dict, *, multiple: int = 1) -> tuple[dict, dict]:
    """``(packed batch, packing_kwargs)`` for ``MimoModel.forward``; see the module docstring.

    The packed batch holds every key of ``batch``; ``input_ids``, ``labels``, ``loss_mask`` become
    ``[1, T]``, ``position_ids`` ``[3, 1, T]``, ``attention_mask`` all ones ``[1, T]``. Encoder inputs
    (pixels, grids, bridge counts) are untouched. ``multiple`` (the language tp under sequence
    parallelism, which splits the T positions over the TP ranks): T is padded up to a multiple of it
    with one segment of its own (``pad_segment``).
    """
    mask = batch["attention_mask"].bool()
    lengths = real_lengths(mask)
    out = dict(batch)
    for key in PACKED_KEYS:
        if batch.get(key) is not None:
            out[key] = batch[key][mask][None]
    out["position_ids"] = batch["position_ids"][:, mask][:, None]
    pad = -int(lengths.sum()) % multiple
    if pad:
        out, lengths = pad_segment(out, pad), torch.cat([lengths, lengths.new_tensor([pad])])
    out["attention_mask"] = torch.ones_like(out["input_ids"], dtype=torch.bool)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    longest = int(lengths.max()) if lengths.numel() else 0
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=longest, max_seqlen_kv=longest)
    return out, kwargs


def pad_segment(packed: dict, pad: int) -> dict:
    """``packed`` with ``pad`` positions appended as a sample of its own: its attention sees only itself
    (its own ``cu_seqlens`` segment), it is never supervised (loss mask 0), and its tokens are the pad id
    (the label of every unsupervised position, ``data.preprocess``), never an image placeholder."""
    out = dict(packed)
    unsupervised = packed["labels"][packed["loss_mask"] == 0]
    pad_id = unsupervised[0] if unsupervised.numel() else packed["labels"][0, -1]
    for key, value in (("input_ids", pad_id), ("labels", pad_id), ("loss_mask", 0)):
        if packed.get(key) is not None:
            out[key] = torch.cat([packed[key], packed[key].new_full((1, pad), value)], dim=1)
    positions = torch.arange(pad, dtype=packed["position_ids"].dtype).expand(3, 1, pad)
    out["position_ids"] = torch.cat([packed["position_ids"], positions], dim=2)
    return out


def computed_positions(batch: dict, *, packed: bool) -> int:
    """Language positions the model computes for ``batch``: every padded position, or only the real
    ones when packed (the denominator of ``padding_fraction``)."""
    if packed:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def pack_documents(batch: dict, *, cp: int, multiple: int = 1, keep_padding: bool = False) -> tuple[dict, dict, torch.Tensor]:
    """The micro-batch as one packed sequence for context parallelism (``model.context_parallel``):
    ``(packed batch, packing_kwargs, rows)``.

    Each document -- a sample's real tokens, or its whole padded row with ``keep_padding`` (``--no-in-batch-packing``:
    the pads are computed, as padded rows compute them) -- is padded to a multiple of ``2 * cp`` after its last
    token, so that it splits into ``2 * cp`` equal chunks (the zigzag); the pads are part of its ``cu_seqlens``
    segment (after every real token, so causal attention and the Gated DeltaNet recurrence never carry them into a
    real one), never supervised, pad id tokens, positions continuing the document's last. The total is padded to a
    multiple of ``2 * cp * multiple`` (sequence parallelism splits each cp share over tp) by a segment of its own.
    ``rows``: host int64 ``[T]``, the sample each packed position came from (-1 for a pad).
    """
    unit = 2 * cp
    mask = batch["attention_mask"].bool()
    b, s = mask.shape
    lengths = torch.full((b,), s, dtype=torch.int64) if keep_padding else real_lengths(mask)
    pad_id = _pad_id(batch)
    src, padded, kept = [], [], []
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        width = -(-n // unit) * unit
        src.append(torch.cat([torch.arange(i * s, i * s + n), torch.full((width - n,), -1, dtype=torch.int64)]))
        padded.append(width)
        kept.append(i)
    src = torch.cat(src)
    real = src >= 0
    take = src.clamp(min=0)
    out = dict(batch)
    for key, fill in (("input_ids", pad_id), ("labels", pad_id), ("loss_mask", 0)):
        if batch.get(key) is not None:
            flat = batch[key].reshape(-1)[take]
            out[key] = torch.where(real, flat, flat.new_full((), fill))[None]
    positions = batch["position_ids"].reshape(3, -1)[:, take]
    out["position_ids"] = _continue_positions(positions, real, padded)[:, None]
    rows = torch.where(real, take // s, torch.full_like(take, -1))
    pad = -src.numel() % (unit * multiple)
    if pad:
        out, padded = pad_segment(out, pad), padded + [pad]
        rows = torch.cat([rows, torch.full((pad,), -1, dtype=torch.int64)])
    out["attention_mask"] = torch.ones_like(out["input_ids"], dtype=torch.bool)
    cu = torch.zeros(len(padded) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(padded, dtype=torch.int64), 0)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    return out, kwargs, rows


def _pad_id(batch: dict):
    """The id of unsupervised positions (``data.preprocess``: the label of every position the loss ignores)."""
    unsupervised = batch["labels"][batch["loss_mask"] == 0]
    return int(unsupervised[0]) if unsupervised.numel() else int(batch["labels"].reshape(-1)[-1])


def _continue_positions(positions: torch.Tensor, real: torch.Tensor, lengths: list) -> torch.Tensor:
    """``positions [3, T]`` with each document's pads (``~real``, after its tokens) at its last position + 1, 2, ..."""
    out = positions.clone()
    start = 0
    for n in lengths:
        doc = real[start:start + n]
        k = int(doc.sum())
        if k < n:
            last = positions[:, start + k - 1:start + k]
            out[:, start + k:start + n] = last + torch.arange(1, n - k + 1, dtype=positions.dtype)
        start += n
    return out


def real_positions(mask: torch.Tensor, rows: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Host bool ``[T]``: which positions of :func:`pack_documents`' sequence are real tokens of the micro-batch
    whose ``attention_mask`` was ``mask [b, s]``. A document is its row's first positions in order (its real
    tokens, or with ``keep_padding`` the whole row, whose pads are computed but are not tokens), then the pads
    to a multiple of ``2 * cp`` (``rows`` -1)."""
    s = mask.shape[1]
    lengths = cu_seqlens.diff().to(torch.int64)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lengths)
    offset = torch.arange(rows.numel(), dtype=torch.int64) - starts
    flat = (rows.clamp(min=0) * s + offset.clamp(max=s - 1))
    return (rows >= 0) & mask.reshape(-1)[flat]
