"""What context parallelism saves per rank: autograd's saved bytes and the step time of a decoder block on a packed row.

Why: ``language=...,cp=N`` is asked for to fit long sequences, so its claim is per-rank memory: each cp rank keeps
the activations of ``1/cp`` of the positions (``model.context_parallel``), plus what does not split (the
all-to-all's indexes over the whole row, K/V repeated where cp does not divide their heads). This runs the
language decoder as training builds it (``testing.saved_bytes.language_layer``: our adapter's config and spec,
``num_layers`` layers, weights as allocated) on one packed row of documents at cp = the world size, this rank's
zigzag share as input, megatron's THD rotary on the whole row's angles, and measures the forward's saved bytes
(distinct storages, parameters and the shared rotary table left out) and one forward + backward's wall time.

Used by ``scripts/bench_cp.py`` (real widths) and ``tests/test_context_parallel.py`` (a tiny width); call it on
every rank of a started world (``parallel.bootstrap.start_world``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def cp_block(hf_dir: str, *, dtype: torch.dtype, num_layers: int):
    """``(block, cfg, cp group)``: ``num_layers`` decoder layers of ``hf_dir`` on a ``language=cp=WORLD`` layout
    (collective: builds every group of the layout)."""
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.parallel.layout import Layout
    from mimo_sft.testing.saved_bytes import language_layer

    cp = dist.get_world_size()
    pstate = build_parallel_state(Layout.from_specs([parse_component(f"language=cp={cp},dp=1")]))
    runtime.init_megatron(0, tp_rank=0)
    extra = {"context_parallel_size": cp, "cp_comm_type": "a2a"} if cp > 1 else {}
    block, cfg = language_layer(hf_dir, dtype=dtype, pstate=pstate, extra=extra, num_layers=num_layers)
    return block, cfg, pstate.modules["language"].pg_collection.cp


def packed_inputs(cfg, lengths: list[int], cp_group, *, dtype: torch.dtype, rotary_percent: float = 1.0):
    """This rank's share of a packed row of documents ``lengths`` (each a multiple of 2*cp): ``(hidden states
    [T/cp, 1, h] requiring grad, the whole row's rotary angles, PackedSeqParams with the split attached)``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    from mimo_sft.model.context_parallel import ContextSplit

    cp = cp_group.size()
    split = ContextSplit.build(lengths, cp=cp, rank=cp_group.rank(), group=cp_group, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(cp_group.rank())
    x = torch.randn(split.local_host.numel(), 1, cfg.hidden_size, generator=gen).to(dtype).requires_grad_()
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, 1, -1).expand(3, 1, -1)
    rope = MultimodalRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=rotary_percent)
    emb = rope(positions, cfg.mrope_section)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    if cp > 1:
        params._mimo_cp = split
    return x, emb, params


def measure(hf_dir: str, lengths: list[int], *, dtype: torch.dtype, num_layers: int = 2,
            timed: bool = True) -> dict:
    """This rank's ``{"saved_bytes", "step_s"}`` for ``num_layers`` layers on the packed row ``lengths`` at cp =
    the world size (``step_s``: one forward + backward, the slowest rank's, 0 unless ``timed``)."""
    from mimo_sft.model.gdn_binding import compiled_helpers
    from mimo_sft.testing.saved_bytes import fla_saved_tensors, flash_sdpa, saved_bytes

    block, cfg, group = cp_block(hf_dir, dtype=dtype, num_layers=num_layers)
    x, emb, params = packed_inputs(cfg, lengths, group, dtype=dtype, rotary_percent=getattr(block, "rotary_percent", 1.0))
    weights = list(block.parameters())
    with flash_sdpa(), fla_saved_tensors(block), compiled_helpers():
        total, out = saved_bytes(block, x, None, rotary_pos_emb=emb, packed_seq_params=params,
                                 exclude=weights + [emb])
    del out
    seconds = 0.0
    if timed:
        with flash_sdpa(), compiled_helpers():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            block(x, None, rotary_pos_emb=emb, packed_seq_params=params).float().sum().backward()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        seconds = float(took)
    return {"saved_bytes": total, "step_s": seconds}
