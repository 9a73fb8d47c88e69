"""Data layer: datasets in, design.md micro-batch dicts out. Never imports model/, train/ or megatron.

Public API (what the training loop, the planner and ``validate`` call)::

    from mimo_sft.data import (build_microbatch_iterator, sample_metadata, dataset_stats,
                               load_sft_dataset, model_token_info, load_processor, CanonicalSampler)

    it = build_microbatch_iterator(cfg.data, model_dir=cfg.model.hf_model,
            micro_batch_size=MBS, canonical_grid=G, dp_size=d, dp_rank=r,
            need_pixels=True,            # False on language-only ranks: no pixel is decoded
            seed=cfg.train.seed, consumed_samples=0, scalable_dp=True,
            global_batch_size=None, num_workers=None)   # None -> cfg.data.num_workers
    batch = next(it)   # endless; keys/shapes exactly as docs/design.md "Micro-batch dict"

    sample_metadata(cfg.data, model_dir=..., indices=None, num_workers=0) -> list[SampleMeta]
        # per sample: image_patches (t*h*w per image), image_tokens, n_tokens, fits; headers only
    dataset_stats(cfg.data, model_dir=...) -> dict           # counts and spreads for logs/validate
    check_fits(source, pre, micro_batch_size=, global_batch_size=)  # the start-up size checks
    build_preprocessor(cfg.data, model_dir) -> SamplePreprocessor   # pass source=/preprocessor= to the
        # functions above to load the dataset and processor once and share them

Samples whose image tokens do not fit in seq_length are replaced by the next dataset index that
fits (``on_truncation=drop``, counted warning) or refused (``error``); ``sample_ids`` shows the
sample actually used. ``labels`` hold the pad id wherever ``loss_mask`` is 0. On encoder ranks a
micro-batch without images has ``pixel_values`` of shape ``[0, C*P*P]`` and ``image_grid_thw``
``[0, 3]``. ``pixel_values`` are uint8 patches (the encoder normalises them: ``model.pixels``).
``build_microbatch_iterator(index_reorder=...)`` balances by index (``data.indexed``), and
``pixel_slice=`` decodes only a colocated rank's encoder slice. Unreadable images become stand-ins
up to ``--max-bad-samples`` (``MicroBatchIterator.bad_samples``); the start-up file check is
``data.file_check`` (streamed, run once per run by training).
    load_sft_dataset(cfg.data) -> SFTSource                  # source[i] -> (messages, image refs)
    model_token_info(model_dir) -> dict                      # image/vision_start/vision_end ids, merge, patch
    load_processor(model_dir) -> QwenVLImageOnlyProcessor    # works on real Qwen2.5-VL folders, no torchvision
    CanonicalSampler(total, micro_batch_size=, canonical_grid=, dp_size=, dp_rank=, dataloader_type=,
                     drop_last=, consumed_samples=, seed=)   # yields this rank's index list per micro-batch

Resume: pass ``consumed_samples`` = micro-batches consumed so far * micro_batch_size; the stream
continues exactly (across epochs, single and cyclic). Every user mistake raises ``UserError``.
Importing this package registers the image-only processor with ``AutoProcessor`` lazily, on first
use of ``load_processor`` (import ``mimo_sft.data.processor`` to register eagerly).

The tiny checkpoint and the synthetic demo dataset used by tests and the demo live in
``mimo_sft.testing``, not here.
"""

from __future__ import annotations

from mimo_sft.lazy_exports import lazy_getattr

_EXPORTS = {
    "build_microbatch_iterator": "mimo_sft.data.loader",
    "sample_metadata": "mimo_sft.data.loader",
    "dataset_stats": "mimo_sft.data.loader",
    "model_token_info": "mimo_sft.data.model_folder",
    "check_fits": "mimo_sft.data.loader",
    "build_preprocessor": "mimo_sft.data.model_folder",
    "SampleMeta": "mimo_sft.data.loader",
    "MicroBatchIterator": "mimo_sft.data.loader",
    "load_sft_dataset": "mimo_sft.data.sources",
    "SFTSource": "mimo_sft.data.sources",
    "load_processor": "mimo_sft.data.processor",
    "QwenVLImageOnlyProcessor": "mimo_sft.data.processor",
    "SamplePreprocessor": "mimo_sft.data.preprocess",
    "collate": "mimo_sft.data.preprocess",
    "CanonicalSampler": "mimo_sft.data.sampler",
}

__all__ = sorted(_EXPORTS)

# lazy: ``import mimo_sft.data`` stays cheap (no transformers/datasets until a name is used)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
