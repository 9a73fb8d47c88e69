"""Which samples the first N micro-batches of training hold, and their loads, without pixels.

Why it goes through the data layer's own pieces: the planner must see the micro-batches training
will see. So the order comes from ``CanonicalSampler`` with the run's length, micro-batch size,
dataloader type, drop_last and seed (concatenating every DP rank's slice gives the global
micro-batch, so one whole-micro-batch sampler stands for all of them); per-sample numbers come from
``sample_metadata`` (image headers, the real chat template and tokenizer, ``smart_resize``); and a
sample whose image tokens do not fit in ``--seq-length`` is replaced the way
``MicroBatchDataset.encode`` replaces it (the next dataset index that fits) or refused as it
refuses it under ``--on-truncation error``.
"""

from __future__ import annotations

from mimo_sft.config.mixture import dataset_label
from mimo_sft.data.loader import build_preprocessor, check_fits, sample_metadata
from mimo_sft.data.mixture import MixtureSource
from mimo_sft.data.sampler import CanonicalSampler
from mimo_sft.data.sources import load_sft_dataset
from mimo_sft.errors import UserError
from mimo_sft.plan.simulate import MicroBatchLoad


class _MetaCache:
    """Per-sample metadata, read on demand (only the samples the planned micro-batches touch).

    In this process, never in DataLoader workers, whatever ``--num-workers`` says: the planner
    starts no processes, and header reads are cheap (hundreds of samples per second).
    """

    def __init__(self, cfg, source, pre):
        self.cfg, self.source, self.pre = cfg, source, pre
        self.metas: dict = {}

    def fetch(self, indices) -> None:
        todo = sorted({int(i) for i in indices} - set(self.metas))
        if todo:
            for m in sample_metadata(self.cfg.data, model_dir=self.cfg.model.hf_model, indices=todo,
                                     num_workers=0, source=self.source,
                                     preprocessor=self.pre):
                self.metas[m.index] = m

    def get(self, i: int):
        self.fetch([i])
        return self.metas[i]


def _effective(cache: _MetaCache, idx: int, n: int, on_truncation: str, seq_length: int, next_index=None):
    """The sample training actually uses at dataset index ``idx`` (see the module docstring); ``next_index``:
    the index that stands in for another (a mixture's: the next row of the same source)."""
    j = idx
    for _ in range(n):
        m = cache.get(j)
        if m.fits:
            return m, j != idx
        if on_truncation == "error":
            raise UserError(f"sample {j}: its image tokens do not fit in --seq-length {seq_length}; raise --seq-length, "
                            "lower --max-pixels, or use --on-truncation drop")
        j = next_index(j) if next_index is not None else (j + 1) % n
    raise UserError(f"no sample of the dataset fits in --seq-length {seq_length}; raise it or lower --max-pixels")


def load_micro_batches(cfg, layout, n_micro_batches: int) -> tuple[list[MicroBatchLoad], dict]:
    """The first ``n_micro_batches`` global micro-batches of a fresh run, and a few data facts."""
    if not cfg.model.hf_model:
        raise UserError("plan needs --hf-model: its tokenizer, chat template and image processor define the loads")
    source = load_sft_dataset(cfg.data)
    pre = build_preprocessor(cfg.data, cfg.model.hf_model)
    mbs = cfg.train.micro_batch_size
    check_fits(source, pre, micro_batch_size=mbs, global_batch_size=cfg.train.global_batch_size)
    n = len(source)
    mixture = isinstance(source, MixtureSource)  # the run's weighted interleave with per-source epochs
    order = dict(order=source.order(seed=cfg.train.seed, shuffle=cfg.data.dataloader_type == "cyclic")) if mixture else {}
    sampler = CanonicalSampler(n, micro_batch_size=mbs, canonical_grid=layout.canonical_grid, dp_size=1, dp_rank=0,
                               dataloader_type=cfg.data.dataloader_type, drop_last=cfg.data.drop_last,
                               consumed_samples=0, seed=cfg.train.seed, whole_micro_batch=True, **order)
    index_lists = [sampler.global_micro_batch(k) for k in range(n_micro_batches)]
    cache = _MetaCache(cfg, source, pre)
    cache.fetch(i for lst in index_lists for i in lst)
    seq = pre.seq_length
    out, replaced, images = [], 0, 0
    for lst in index_lists:
        ids, patches, tokens, counts = [], [], [], []
        for i in lst:
            m, moved = _effective(cache, i, n, cfg.data.on_truncation, seq,
                                  source.next_index if mixture else None)
            replaced += moved
            images += len(m.image_patches)
            ids.append(m.index)
            patches.append(float(sum(m.image_patches)))
            counts.append(len(m.image_patches))
            tokens.append(float(min(m.n_tokens, seq)))  # attention_mask.sum() after truncation
        out.append(MicroBatchLoad(ids, patches, tokens, counts))
    if images == 0:
        raise UserError(f"the {n_micro_batches} planned micro-batches of {dataset_label(cfg.data)} hold no images: "
                        "the vision encoder has no load to balance (reordering helps image data only)")
    facts = {"dataset_samples": n, "samples_read": len(cache.metas), "replaced_too_long": replaced,
             "images": images, "epoch_micro_batches": sampler.micro_batches_per_epoch, "patch_bytes": pre.pixel_dim}
    return out, facts
