"""How the language model's gradients are cut into megatron DDP buckets, and why checkpoints care.

With ``--overlap-grad-reduce`` megatron reduces the language model's gradients bucket by bucket
(``--ddp-bucket-size`` parameters each; without overlap, one bucket). The distributed optimizer's
default checkpoint form (``dp_reshardable``, ``train.checkpoint.optimizer``) stores its flat buffers
per bucket, so a resume must cut the buckets as the save did: :func:`language_bucket_size` takes the
checkpoint's bucket size (``meta.json``'s ``language_ddp_bucket_size``; a checkpoint without it was
saved as one bucket) over this run's flags, and says so when they differ. ``--save-reshardable``
checkpoints store parameter-shaped tensors and resume with any buckets.

The default is megatron's 40M parameters, not its ``max(40M, 1M x DP)``: a bucket size that follows
the DP size would cut the buckets differently on a resume with another DP size (beyond DP 40).
"""

from __future__ import annotations

from typing import Optional

from mimo_sft.config.lora import distributed_optimizer_in_use
from mimo_sft.errors import UserError

#: parameters per bucket when --ddp-bucket-size is not given (megatron's own floor)
DEFAULT_BUCKET_SIZE = 40_000_000
#: the checkpoint meta.json key holding the language model's bucket size (None: one bucket)
META_KEY = "language_ddp_bucket_size"


def requested_bucket_size(cfg) -> Optional[int]:
    """The bucket size this run's flags ask for (None: one bucket, as without overlapped reduction)."""
    o = cfg.optimizer
    if not o.overlap_grad_reduce:
        return None
    return o.ddp_bucket_size or DEFAULT_BUCKET_SIZE


def language_bucket_size(cfg, *, announce: bool) -> Optional[int]:
    """The language model's bucket size: the flags', except on a resume of a distributed-optimizer
    checkpoint in the DP-reshardable form, whose buffers only load into the buckets they were saved in."""
    from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint
    from mimo_sft.train.checkpoint.optimizer import DP_RESHARDABLE, saved_format

    wanted = requested_bucket_size(cfg)
    path = cfg.checkpoint.load_checkpoint
    if not path or not distributed_optimizer_in_use(cfg):
        return wanted
    try:
        meta = read_meta(resolve_checkpoint(path))
    except UserError:
        return wanted  # train.checkpoint.restore says what is wrong with the folder
    if saved_format(meta) != DP_RESHARDABLE:
        return wanted
    saved = meta.get(META_KEY)
    if saved != wanted and announce:
        print(f"mimo-sft: the language model's gradient buckets follow --load-checkpoint's "
              f"({_describe(saved)}, not {_describe(wanted)}): its distributed-optimizer state is stored per "
              f"bucket (a checkpoint saved with --save-reshardable resumes with any)", flush=True)
    return saved


def _describe(size: Optional[int]) -> str:
    return "one bucket" if size is None else f"buckets of {size:,} parameters"


def check_bucket_shards(ddp_module, bucket_size: Optional[int]) -> None:
    """Refuse, before step 0, buckets in which a DP rank's shard holds no parameter element:
    megatron's distributed-optimizer checkpoint asserts on such a shard ("empty bucket encountered")
    when the first checkpoint is saved. It happens only with buckets smaller than about 128 x DP
    elements (a small ``--ddp-bucket-size`` on a small model, or the remainder before a pipeline
    stage's shared embedding)."""
    if not ddp_module.ddp_config.use_distributed_optimizer:
        return
    dp = ddp_module.intra_dp_cp_group.size()
    for buffer in ddp_module.buffers:
        for bucket in buffer.buckets:
            ranges = [buffer.param_index_map[p][:2] for p in bucket.params_list]
            shard = bucket.grad_data.numel() // dp
            for r in range(dp):
                lo, hi = bucket.offset + r * shard, bucket.offset + (r + 1) * shard
                if not any(start < hi and end > lo for start, end in ranges):
                    raise UserError(
                        f"--ddp-bucket-size {bucket_size}: the language model's gradient bucket {bucket.bucket_id} "
                        f"holds {bucket.numel_unpadded} parameters, too few for its {dp} DP ranks to each own "
                        f"some (megatron's distributed-optimizer checkpoint cannot save an empty shard); choose "
                        f"a larger --ddp-bucket-size, or --no-overlap-grad-reduce")
