"""Split a micro-batch into per-sample records, pack records into bytes, and back (pure).

Records are what moves between ranks. A record holds one sample's slice of every field with the
batch dimension kept (size 1), so merging is a plain ``torch.cat`` and works whether or not the
vision keys are present (language-only ranks never hold ``pixel_values``):

* ``position_ids`` ``[3, B, S]`` is split on dim 1 (mRoPE's three rows travel together);
* ``pixel_values`` ``[sum patches, D]`` is split by patch rows, ``image_grid_thw`` ``[n_images, 3]``
  by images, using ``image_counts`` and the per-image ``t*h*w``; a text-only sample gets zero rows of
  the right width and dtype, so every record has the same keys;
* every other tensor is split on dim 0, which must be ``B``.

Byte packing puts each field at an 8-byte-aligned offset so the receiver can ``view`` the received
buffer as the field's dtype without a copy. Only the small metadata (key, dtype code, shape) has
to reach the receiver out of band; sizes follow from it.

No ``torch.distributed`` here: everything is exercised by unit tests without processes.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

ALIGN = 8

#: dtype <-> short code carried in metadata. Fixed table: both sides must agree.
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
    torch.uint8: "u8",
}
CODE_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}
#: bytes per element of each code, computed once: the exchange sizes every record of a window
_ITEMSIZE: dict[str, int] = {code: torch.empty((), dtype=dt).element_size() for code, dt in CODE_DTYPES.items()}

PIXEL_KEY = "pixel_values"
GRID_KEY = "image_grid_thw"
COUNT_KEY = "image_counts"
POSITION_KEY = "position_ids"

Record = dict[str, torch.Tensor]
#: per-record metadata: ((key, dtype code, shape), ...) in sorted key order
RecordMeta = tuple[tuple[str, str, tuple[int, ...]], ...]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def batch_size_of(batch: Mapping[str, torch.Tensor]) -> int:
    """Samples in a micro-batch, read from a field every rank holds."""
    for key in ("input_ids", "sample_ids", COUNT_KEY):
        if key in batch:
            return int(batch[key].shape[0])
    raise KeyError("micro-batch has none of input_ids / sample_ids / image_counts")


def image_row_offsets(batch: Mapping[str, torch.Tensor]) -> tuple[list[int], list[int]] | None:
    """Cumulative image offsets ``[0, c0, c0+c1, ...]`` and patch-row offsets per sample.

    None when the batch carries no pixels. Raises when the counts disagree with the tensors, since
    a silent mismatch would hand one sample's image rows to another.
    """
    if PIXEL_KEY not in batch:
        return None
    if GRID_KEY not in batch or COUNT_KEY not in batch:
        raise ValueError("pixel_values needs image_grid_thw and image_counts to be split per sample")
    counts = [int(c) for c in batch[COUNT_KEY].tolist()]
    grid = batch[GRID_KEY]
    if sum(counts) != grid.shape[0]:
        raise ValueError(f"image_counts sum {sum(counts)} != image_grid_thw rows {grid.shape[0]}")
    per_image = grid.prod(dim=-1).tolist() if grid.shape[0] else []
    img_off = [0]
    for c in counts:
        img_off.append(img_off[-1] + c)
    row_at_image = [0]
    for p in per_image:
        row_at_image.append(row_at_image[-1] + int(p))
    if row_at_image[-1] != batch[PIXEL_KEY].shape[0]:
        raise ValueError(
            f"image_grid_thw covers {row_at_image[-1]} patch rows, pixel_values has {batch[PIXEL_KEY].shape[0]}"
        )
    rows = [row_at_image[i] for i in img_off]
    return img_off, rows


def split_samples(batch: Mapping[str, torch.Tensor]) -> list[Record]:
    """One record per sample, in batch order. Records are views into ``batch`` (no copy)."""
    n = batch_size_of(batch)
    offs = image_row_offsets(batch)
    records: list[Record] = [{} for _ in range(n)]
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"micro-batch field {key!r} is {type(value).__name__}, expected a tensor")
        if key == PIXEL_KEY or key == GRID_KEY:
            img_off, rows = offs  # type: ignore[misc]
            bounds = rows if key == PIXEL_KEY else img_off
            for b in range(n):
                records[b][key] = value[bounds[b] : bounds[b + 1]]
        elif key == POSITION_KEY:
            if value.dim() != 3 or value.shape[1] != n:
                raise ValueError(f"position_ids must be [3, {n}, S], got {tuple(value.shape)}")
            for b in range(n):
                records[b][key] = value[:, b : b + 1]
        else:
            if value.dim() == 0 or value.shape[0] != n:
                raise ValueError(f"field {key!r} shape {tuple(value.shape)} has no batch dim of {n}")
            for b in range(n):
                records[b][key] = value[b : b + 1]
    return records


def merge_samples(records: Sequence[Record]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_samples`: concatenate records (in the given order) into a batch."""
    if not records:
        raise ValueError("cannot merge an empty list of samples")
    keys = list(records[0].keys())
    for r in records[1:]:
        if set(r.keys()) != set(keys):
            raise RuntimeError(f"samples disagree on fields: {sorted(keys)} vs {sorted(r.keys())}")
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [r[key] for r in records]
        out[key] = torch.cat(parts, dim=1 if key == POSITION_KEY else 0)
    return out


def permute_batch(batch: Mapping[str, torch.Tensor], order: Sequence[int]) -> dict[str, torch.Tensor]:
    """``batch`` with its samples in ``order`` (new sample k = old sample ``order[k]``), by indexing.

    The DP-1 path: one gather per field, no per-sample records, no byte packing. Pixel rows move
    by whole samples. An identity order returns the batch as it is.
    """
    n = batch_size_of(batch)
    order = list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order {order} is not a permutation of {n} samples")
    if order == list(range(n)):
        return dict(batch)
    idx = torch.tensor(order, dtype=torch.long)
    offs = image_row_offsets(batch)
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if key == PIXEL_KEY or key == GRID_KEY:
            img_off, rows = offs  # type: ignore[misc]
            bounds = rows if key == PIXEL_KEY else img_off
            out[key] = torch.cat([value[bounds[b] : bounds[b + 1]] for b in order], dim=0)
        elif key == POSITION_KEY:
            out[key] = value.index_select(1, idx)
        else:
            out[key] = value.index_select(0, idx)
    return out


# ---------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------
def record_meta(record: Record) -> RecordMeta:
    """Metadata that lets a receiver size and decode a record without its bytes."""
    meta = []
    for key in sorted(record):
        t = record[key]
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise ValueError(f"field {key!r} has dtype {t.dtype}, which the exchange does not carry")
        meta.append((key, code, tuple(int(s) for s in t.shape)))
    return tuple(meta)


def _field_nbytes(code: str, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * _ITEMSIZE[code]


def record_nbytes(meta: RecordMeta) -> int:
    """Serialized size of a record: every field padded to :data:`ALIGN` bytes."""
    return sum(_aligned(_field_nbytes(code, shape)) for _, code, shape in meta)


def serialize_records(
    records: Sequence[Record], metas: Sequence[RecordMeta] | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack records back to back into one 1-D uint8 tensor (fields in metadata order, aligned).

    ``out`` (a 1-D uint8 CPU tensor of exactly the packed size) lets the caller reuse a buffer:
    a fresh tensor of tens of MB costs several times its copy in page faults.
    """
    metas = [record_meta(r) for r in records] if metas is None else list(metas)
    total = sum(record_nbytes(m) for m in metas)
    if out is None:
        buf = torch.empty(total, dtype=torch.uint8)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total:
            raise ValueError(f"out must be a 1-D uint8 tensor of {total} bytes")
        buf = out
    off = 0
    for rec, meta in zip(records, metas):
        for key, code, shape in meta:
            t = rec[key]
            nb = _field_nbytes(code, shape)
            if nb:
                buf[off : off + nb].copy_(t.contiguous().reshape(-1).view(torch.uint8))
            pad = _aligned(nb) - nb
            if pad:
                buf[off + nb : off + nb + pad].zero_()
            off += _aligned(nb)
    assert off == total
    return buf


def deserialize_records(buf: torch.Tensor, metas: Sequence[RecordMeta], offset: int = 0) -> tuple[list[Record], int]:
    """Decode consecutive records from ``buf`` starting at ``offset``; returns them and the end offset.

    Fields are views into ``buf`` (it must stay alive; :func:`merge_samples` copies). Raises
    RuntimeError when the buffer is shorter than the metadata says.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise RuntimeError(f"expected a 1-D uint8 buffer, got {buf.dtype} {tuple(buf.shape)}")
    need = offset + sum(record_nbytes(m) for m in metas)
    if need > buf.numel():
        raise RuntimeError(f"received buffer holds {buf.numel()} bytes, metadata needs {need}")
    if offset % ALIGN:
        raise RuntimeError(f"record offset {offset} is not {ALIGN}-byte aligned")
    out: list[Record] = []
    off = offset
    for meta in metas:
        rec: Record = {}
        for key, code, shape in meta:
            dtype = CODE_DTYPES[code]
            nb = _field_nbytes(code, shape)
            if nb:
                rec[key] = buf[off : off + nb].view(dtype).view(shape)
            else:
                rec[key] = torch.empty(shape, dtype=dtype, device=buf.device)
            off += _aligned(nb)
        out.append(rec)
    return out, off
