"""The largest micro-batch a dataset can form, from its per-row counts: check 23's workload when they are known.

Why: the worst case (``forecast.worst_case_workload``: every sample ``--seq-length`` tokens, all of them
image tokens) refuses runs that fit -- a document set whose rows hold 2,000 real tokens and two 0.5 Mpx pages
was forecast at 168 GiB on a GPU where it peaked at 104.5. ``check-data --write-costs`` has counted every row
(``data.cost_file``: its real tokens, its image tokens and each image's grid), so the forecast can take the
heaviest micro-batch those rows can make instead.

The bound. A rank computes ``B`` rows of a micro-batch (``micro_batch_size / dp`` of its module, after the
canonical split; reordering moves rows between ranks but every rank keeps ``B`` of them). What it keeps for
backward is a sum over its rows of per-row quantities, each with a non-negative weight (``memory.activations``):

* language: real tokens (packed), or ``B x --seq-length`` padded positions (padded rows, ``B x`` the longest
  row with ``--no-pad-to-seq-length``), and the padded attention slots of the packed segments;
* vision: patches, and the padded slots of each windowed and full-attention block's segments;
* the bridge: image tokens.

So the sum of the ``B`` largest values of each quantity, taken separately, bounds every micro-batch the sampler
can form, whichever rows it draws. A row may stand more than once in one micro-batch: a row whose image tokens
pass ``--seq-length`` is replaced by the next row that fits (which then also stands for it), and a mixture's
source starts a new epoch in the middle of a micro-batch; each row counts as often as that allows.

Attention padding (``model.segments``): every segment (a packed sample; a window or an image's frame group in
the tower) is copied into a row of a padded batch, so its q, k, v copies, output and log-sum-exp are kept per
padded slot. The grouping bounds it, whatever company a segment keeps: a group of segments whose padded
score work passes ``SMALL_WORK`` holds at most ``(1 + SLACK)`` times its real work, so its padded slots are at
most ``(1 + SLACK)`` times its real ones; a group under ``SMALL_WORK`` with two or more members is at most
``SHORT`` (360) wide, so each member takes at most ``SHORT`` slots; a segment alone is padded to a multiple
of ``ALIGN``. Each segment of ``n`` positions therefore takes at most ``max((1 + SLACK) n, SHORT if n <= SHORT)``
slots (:func:`segment_slots`), a window at most the widest window (64 patches for Qwen2.5-VL). Both are sums
over a row's segments, so they bound as above.

Pure: numpy only (no torch, no megatron); ``data.cost_file.load_row_counts`` builds :class:`RowCounts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mimo_sft.memory.dims import VisionDims
from mimo_sft.memory.workload import Workload
from mimo_sft.parallel.layout import IMAGES, LANGUAGE

#: ``model.segments``' grouping, copied here because memory/ stays torch-free (tests hold them equal)
ALIGN, SLACK, SMALL_WORK = 8, 0.25, 512 * 512
#: the widest row of a group of two or more segments whose padded work stays under ``SMALL_WORK``
SHORT = math.isqrt(SMALL_WORK // 2) // ALIGN * ALIGN


@dataclass
class SourceRows:
    """One source's rows that can train (its dropped rows left out; ``data.cost_file``)."""

    tokens: np.ndarray        # real tokens of each row, at most --seq-length
    image_tokens: np.ndarray  # image tokens of each row (clips' included)
    stands_for: np.ndarray    # dataset rows that give this row: itself and the dropped rows it replaces
    image_rows: np.ndarray    # for each image or clip, its row (an index into ``tokens``)
    grids: np.ndarray         # for each image or clip, ``[t, h, w]`` in patches

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class RowCounts:
    """Every source's rows (``sources``), from the cost files ``files``; ``unknown``: rows check-data could not
    encode, whose counts nobody knows (the worst case then stays in force)."""

    sources: list[SourceRows]
    mixture: bool
    unknown: int = 0
    files: list[str] = field(default_factory=list)
    #: each quantity's largest sum, by quantity, rows per rank and model sizes (``data_workload``)
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return sum(len(s) for s in self.sources)


def segment_slots(n) -> np.ndarray:
    """Padded attention slots a segment of ``n`` positions can take at most, in any company (module docstring)."""
    n = np.asarray(n, dtype=np.int64)
    return np.maximum(np.ceil((1 + SLACK) * n).astype(np.int64), np.where(n <= SHORT, SHORT, 0)) * (n > 0)


def window_tiles(v: VisionDims) -> int:
    """Merged tokens per side of one attention window (Qwen2.5-VL: 112 px / 28 = 4); 0: no windowed blocks."""
    return v.window // (v.patch * v.merge) if v.window else 0


def image_slots(v: VisionDims, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per image or clip ``[t, h, w]``: the most padded slots its segments take in one windowed block and in one
    full-attention block. A full-attention block attends per frame group (``t`` segments of ``h w``); a windowed
    block per window of ``tiles x tiles`` merged tokens (partial at the edges), none wider than a whole one."""
    t, h, w = (grids[:, k].astype(np.int64) for k in range(3))
    full = t * segment_slots(h * w)
    tiles = window_tiles(v)
    if not tiles:
        return full, full
    windows = t * -(-(h // v.merge) // tiles) * -(-(w // v.merge) // tiles)
    widest = -(-(tiles * v.merge) ** 2 // ALIGN) * ALIGN
    return windows * widest, full


def _row_values(src: SourceRows, v: VisionDims, name: str) -> np.ndarray:
    """One quantity a rank's activations grow with, per row of ``src``."""
    if name in ("tokens", "image_tokens"):
        return getattr(src, name).astype(np.int64)
    if name == "token_slots":
        return segment_slots(src.tokens)
    if name == "patches":
        return src.image_tokens.astype(np.int64) * v.merge ** 2
    windowed, full = image_slots(v, src.grids) if len(src.grids) else (np.zeros(0), np.zeros(0))
    per_image = windowed if name == "window_slots" else full
    return np.bincount(src.image_rows, weights=per_image, minlength=len(src)).astype(np.int64)


def _copies(src: SourceRows, *, mixture: bool, batch: int) -> np.ndarray:
    """How often each row can stand in one micro-batch (before capping at ``batch``): once for itself and each
    dropped row it replaces, and once more per epoch a mixture's source can start inside one micro-batch."""
    epochs = -(-batch // len(src)) + 1 if mixture else 1
    return src.stands_for.astype(np.int64) * epochs


def top_sum(values: list[np.ndarray], copies: list[np.ndarray], batch: int) -> int:
    """The largest sum of ``batch`` values, each value taken at most its ``copies`` times (over every source)."""
    picked_v, picked_c = [], []
    for val, cop in zip(values, copies):
        if len(val) > batch:  # each value stands at least once: the largest ``batch`` of a source hold the answer
            keep = np.argpartition(-val, batch - 1)[:batch]
            val, cop = val[keep], cop[keep]
        picked_v.append(val)
        picked_c.append(cop)
    val, cop = np.concatenate(picked_v), np.minimum(np.concatenate(picked_c), batch)
    order = np.argsort(-val, kind="stable")
    return int(np.repeat(val[order], cop[order])[:batch].sum())


def _peak_ratio(v: VisionDims, counts: RowCounts) -> tuple[float, float]:
    """The most window / full-attention slots per patch of any one image: what bounds a tower that encodes
    images of several rows (``--encoder-balance`` moves single images between towers)."""
    ratios = [(0.0, 0.0)]
    for src in counts.sources:
        if len(src.grids):
            windowed, full = image_slots(v, src.grids)
            patches = np.prod(src.grids.astype(np.int64), axis=1)
            ratios.append((float(np.max(windowed / patches)), float(np.max(full / patches))))
    return max(r[0] for r in ratios), max(r[1] for r in ratios)


def data_workload(cfg, layout, hf_config: dict, counts: RowCounts):
    """The heaviest micro-batch ``counts``' rows can form on one rank of each module (``forecast.Workload``)."""
    v = VisionDims.from_config(hf_config)
    mbs, seq, d = cfg.train.micro_batch_size, cfg.data.seq_length, cfg.data
    lang = layout.spec(LANGUAGE)
    b_lang = max(1, mbs // lang.dp)
    b_vis = max(1, mbs // (layout.spec(IMAGES).dp if IMAGES in layout.names else 1))

    def top(name: str, batch: int) -> int:
        key = (name, batch, v.merge, v.patch, window_tiles(v))
        if key not in counts.cache:  # (kept: the cheapest fix forecasts the same rows on several layouts)
            values = [_row_values(s, v, name) for s in counts.sources if len(s)]
            copies = [_copies(s, mixture=counts.mixture, batch=batch) for s in counts.sources if len(s)]
            counts.cache[key] = top_sum(values, copies, batch)
        return counts.cache[key]

    if d.in_batch_packing:
        pad = lang.tp - 1 if cfg.model.sequence_parallel and lang.tp > 1 else 0  # a segment of its own
        tokens, slots = top("tokens", b_lang) + pad, top("token_slots", b_lang) + (SHORT if pad else 0)
        shape = "packed"
    else:
        longest = seq if d.pad_to_seq_length else max(int(s.tokens.max()) for s in counts.sources if len(s))
        tokens = slots = b_lang * longest
        shape = f"rows padded to {longest:,}"
    patches = top("patches", b_vis)
    if cfg.reorder.encoder_balance and layout.colocated:
        ratio_w, ratio_f = _peak_ratio(v, counts)
        windowed, full = math.ceil(ratio_w * patches), math.ceil(ratio_f * patches)
    else:
        windowed, full = top("window_slots", b_vis), top("full_slots", b_vis)
    units = [int((s.grids[:, 1] * s.grids[:, 2]).max()) for s in counts.sources if len(s.grids)]
    return Workload(language_tokens=tokens, image_patches=patches, image_tokens=top("image_tokens", b_lang),
                    language_slots=slots, window_slots=windowed, image_slots=full, unit_patches=max(units, default=0),
                    source=f"this data: the largest micro-batch its {counts.rows:,} rows can form ({b_lang} rows, "
                           f"{tokens:,} tokens {shape} on one language rank; {b_vis} rows, {patches:,} patches on "
                           f"one vision rank; check-data's cost file)")
