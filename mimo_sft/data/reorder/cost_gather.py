"""Index mode's one collective: every DP rank's shard costs, so that each rank plans the whole micro-batch.

Why a float64 tensor all-gather and not ``all_gather_object``: it is one collective per micro-batch
(the object form is two, plus pickling), of ``1 + 3 * per`` numbers per rank -- an error flag, then
the shard's dataset indices, costs and stats loads. float64 carries all three exactly: the costs
are float64 already (``cost_model.weighted_costs``), loads are patch counts, and dataset indices
stay below 2**53.

Errors: a rank that cannot compute its shard (a sample refused with one line, ``UserError``) still
joins the collective, with its flag set; every rank then sees the flag and one object all-gather
carries the messages, so every rank raises the same line -- instead of the failing rank leaving and
the others waiting in the next collective until ``--dist-timeout``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def gather_shard_costs(indices: Sequence[int], costs: Sequence[float], loads: Sequence[float], *, per: int,
                       dp_size: int, group: Any, error: str | None = None
                       ) -> tuple[list[int], list[float], list[float]] | str:
    """The whole micro-batch's ``(indices, costs, loads)`` in position order (DP rank r's shard is
    positions ``[r*per, (r+1)*per)``), or the first failing rank's message when any rank brings
    ``error``. Collective over ``group`` (gloo): every rank must call it once per micro-batch."""
    row = torch.zeros(1 + 3 * per, dtype=torch.float64)
    if error is None:
        if not len(indices) == len(costs) == len(loads) == per:
            raise RuntimeError(f"a shard of {per} samples brought {len(indices)} indices, {len(costs)} costs and "
                               f"{len(loads)} loads")
        row[1:] = torch.tensor([*indices, *costs, *loads], dtype=torch.float64)
    else:
        row[0] = 1.0
    rows = [torch.empty_like(row) for _ in range(dp_size)]
    dist.all_gather(rows, row, group=group)
    if any(float(r[0]) for r in rows):
        messages: list[Any] = [None] * dp_size
        dist.all_gather_object(messages, error, group=group)
        return next(m for m in messages if m is not None)
    table = torch.stack(rows)[:, 1:].reshape(dp_size, 3, per).transpose(0, 1).reshape(3, dp_size * per)
    return [int(i) for i in table[0].tolist()], table[1].tolist(), table[2].tolist()
