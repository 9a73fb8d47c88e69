"""Which data this rank reads: module, DP coordinates, pixels or not (then ``Feed`` wraps it)."""

from __future__ import annotations

from mimo_sft.data.loader import build_microbatch_iterator
from mimo_sft.parallel.layout import LANGUAGE
from mimo_sft.train.feed import Feed, colocated_read_plan


def build_feed(cfg, layout, pstate, info, *, consumed_samples: int) -> Feed:
    rank = pstate.rank
    mine = pstate.mine()
    mbs = cfg.train.micro_batch_size
    common = dict(model_dir=cfg.model.hf_model, micro_batch_size=mbs, canonical_grid=layout.canonical_grid,
                  seed=cfg.train.seed, consumed_samples=consumed_samples, scalable_dp=cfg.parallel.scalable_dp,
                  global_batch_size=cfg.train.global_batch_size)
    if layout.colocated:
        module, dp_rank, dp_size, lang_sl, enc_sl = colocated_read_plan(layout, rank, mbs)
        source = build_microbatch_iterator(cfg.data, dp_size=dp_size, dp_rank=dp_rank, need_pixels=True, **common)
        return Feed(source, layout=layout, pstate=pstate, reorder_cfg=cfg.reorder, model_info=info,
                    colocated_slices=(lang_sl, enc_sl))
    (module,) = mine
    coord = layout.coords(rank)[module]
    source = build_microbatch_iterator(cfg.data, dp_size=layout.spec(module).dp, dp_rank=coord.dp,
                                       need_pixels=module != LANGUAGE, **common)
    return Feed(source, layout=layout, pstate=pstate, reorder_cfg=cfg.reorder, model_info=info)
