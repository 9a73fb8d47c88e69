"""The validation set: where it comes from, which rows it holds, and each rank's share of it.

Why here: the validation set is data like the training set (same loader, schemas, preprocessing,
canonical-grid shards), but read differently: a fixed prefix of the set in dataset order, every
evaluation the same samples, each evaluated once. The last micro-batch is filled up to
``micro_batch_size`` with copies of the first samples whose ``loss_mask`` is zeroed, so every rank
sees whole micro-batches and the loss counts each sample exactly once.

Sources (:func:`split_sources`): ``--valid-dataset-path`` (loaded exactly as the training set,
with ``--valid-dataset-split``), or ``--valid-split N|FRACTION`` held out of the training set: a
seeded choice of rows (``--seed``), the validation rows in dataset order, and the training source
then holds only the other rows, so the training sampler never sees them and ``consumed_samples``
counts positions of that smaller set (a resume with the same flags reads the same stream).

Before step 0 the evaluated samples are tokenised (image and clip headers only, a clip planned as
training plans it): a sample whose image or video tokens do not fit ``--seq-length`` is refused rather
than replaced (the value must be the loss of the samples the user named), and so is a set without
supervised tokens. A refused sample's line says it is a validation sample and names its file and row
(:func:`validation_line`), at start-up and at an evaluation alike. Training splits that work
over the ranks (:func:`shard_tokens` on every ``world``-th sample, the verdicts combined in
``train.evaluate``); :func:`check_validation_set` is the same check in one process.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator, Optional

import torch

from mimo_sft.config.checks.validation import held_out, parse_eval_iters
from mimo_sft.config.checks.validation import parse_valid_split as config_valid_split
from mimo_sft.config.mixture import mixture_specs, per_source_validation
from mimo_sft.data.microbatch import ERROR_KEY, MicroBatchDataset, MicroBatchIterator, identity, worker_init
from mimo_sft.data.preprocess import SamplePreprocessor
from mimo_sft.data.mixture import InterleavedView, MixtureSource
from mimo_sft.data.sampler import RankShare
from mimo_sft.data.source_probe import VALID_SET, source_valid_set
from mimo_sft.data.sources import SFTSource, load_sft_dataset
from mimo_sft.errors import UserError


def parse_valid_split(text: Optional[str]) -> Optional[float | int]:
    """``"16"`` -> 16 samples, ``"0.1"`` -> a fraction, None when unset (the rule of check 28)."""
    try:
        return config_valid_split(text)
    except ValueError as e:
        raise UserError(str(e)) from None


def holdout_rows(total: int, valid_split: float | int, *, seed: int, min_train: int) -> tuple[list[int], list[int]]:
    """``(training rows, validation rows)`` of a dataset of ``total`` rows, both ascending.

    The validation rows are a seeded random choice (``seed``), so a dataset sorted by topic still
    gives a representative set; the same flags always give the same rows. ``min_train``: the
    training rows must still fill one global batch.
    """
    n_valid, refused = held_out(total, valid_split, min_train=min_train)
    if refused:
        raise UserError(refused)
    g = torch.Generator()
    g.manual_seed(int(seed))
    chosen = set(torch.randperm(total, generator=g)[:n_valid].tolist())
    train = [i for i in range(total) if i not in chosen]
    return train, sorted(chosen)


def subset_source(source: SFTSource, rows: list[int]) -> SFTSource:
    """The same source restricted to ``rows`` (in that order): row ``i`` of the result is ``rows[i]``
    of ``source``. ``datasets`` selects through an index mapping, nothing is copied. Its messages name
    the file's row (``SFTSource.file_rows``), not the subset's."""
    out = SFTSource(source.ds.select(rows), schema=source.schema, text_column=source.text_column,
                    images_column=source.images_column, base_dir=source.base_dir, image_root=source.image_root,
                    dataset_path=source.dataset_path)
    out.file_rows = [source.file_rows[r] for r in rows] if source.file_rows is not None else list(rows)
    return out


def split_sources(data_cfg, *, seed: int, global_batch_size: int,
                  load_full: Optional[Callable[[], SFTSource]] = None,
                  load_valid: Optional[Callable[..., SFTSource]] = None) -> tuple[Optional[SFTSource], Optional[SFTSource]]:
    """``(training source, validation source)``; the training source is None where the trainer loads
    it as before (no ``--valid-split``), the validation source None without a validation set.
    ``load_full``: how the whole training set is opened for ``--valid-split`` (training: with its
    image files checked on one rank, ``train.feed.checked_source``); ``load_valid(data_cfg)``: how
    ``--valid-dataset-path`` is opened (the same, with the validation set's config); both default to
    ``load_sft_dataset`` (opened and checked in this process)."""
    specs = mixture_specs(data_cfg)
    if specs is not None and per_source_validation(specs):
        return None, _per_source_valid(specs, load_valid or load_sft_dataset)
    if data_cfg.valid_dataset_path:
        valid_cfg = dataclasses.replace(data_cfg, dataset_path=data_cfg.valid_dataset_path,
                                        split=data_cfg.valid_dataset_split, datasets=[], dataset_weights=None)
        try:
            return None, (load_valid or load_sft_dataset)(valid_cfg)
        except UserError as e:  # the loader names the training flags; say which set it was
            raise UserError(f"{VALID_SET}: {e}") from None
    split = parse_valid_split(data_cfg.valid_split)
    if split is None:
        return None, None
    full = load_full() if load_full is not None else load_sft_dataset(data_cfg)
    if isinstance(full, MixtureSource):  # each source holds out its own rows (its sources repeat: min 1 left)
        cuts = [holdout_rows(len(p), split, seed=seed, min_train=1) for p in full.parts]
        train = MixtureSource([subset_source(p, t) for p, (t, _v) in zip(full.parts, cuts)], full.names, full.shares)
        valid = MixtureSource([subset_source(p, v) for p, (_t, v) in zip(full.parts, cuts)], full.names, full.shares)
        return train, InterleavedView(valid)
    train_rows, valid_rows = holdout_rows(len(full), split, seed=seed, min_train=global_batch_size)
    return subset_source(full, train_rows), subset_source(full, valid_rows)


def _per_source_valid(specs, load_valid) -> InterleavedView:
    """The validation sets the sources name (``valid_path``), read round-robin over the sources so
    every prefix of ``--eval-iters`` holds each of them; a source without one is not evaluated."""
    parts, names, shares = [], [], []
    for spec in specs:
        if not spec.data.valid_dataset_path:
            continue
        one = dataclasses.replace(spec.data, dataset_path=spec.data.valid_dataset_path,
                                  split=spec.data.valid_dataset_split, valid_dataset_path=None)
        try:
            parts.append(load_valid(one))
        except UserError as e:
            raise UserError(f"{source_valid_set(spec.name, spec.data.valid_dataset_path)}: {e}") from None
        names.append(spec.name)
        shares.append(spec.weight)
    return InterleavedView(MixtureSource(parts, names, shares))


def check_resumed_split(saved_split, data_cfg, *, checkpoint: str) -> None:
    """A resumed run must hold out what the saved run held out: ``consumed_samples`` counts
    positions of the training part, so another split would continue a different stream."""
    if parse_valid_split(saved_split) != parse_valid_split(data_cfg.valid_split):
        saved = f"--valid-split {saved_split}" if saved_split is not None else "no --valid-split"
        raise UserError(f"--load-checkpoint {checkpoint} was trained with {saved}; resume with the same "
                        f"(its data position counts samples of that training set)")


def valid_flag(data_cfg) -> str:
    """The flag that named the validation set (for messages)."""
    return "--valid-dataset-path" if data_cfg.valid_dataset_path else "--valid-split"


def evaluated_samples(n_valid: int, *, eval_iters, global_batch_size: int) -> int:
    """Samples one evaluation reads: the first ``eval_iters`` global batches, or all (``"all"``, or
    the old ``0``); ``eval_iters`` as ``--eval-iters`` gives it (text or a number)."""
    try:
        batches = parse_eval_iters(eval_iters)
    except ValueError as e:
        raise UserError(str(e)) from None
    return n_valid if batches is None else min(n_valid, batches * global_batch_size)


def validation_row(source, i: int) -> str:
    """Where validation sample ``i`` is, for a message: its file (a mixture's: the source's name too) and its
    row there (for ``--valid-split``, the row of the training file it was held out of)."""
    if isinstance(source, InterleavedView):
        source, i = source.mixture, source.map[int(i)]
    if isinstance(source, MixtureSource):
        s, row = source.locate(i)
        return f"source '{source.names[s]}', {validation_row(source.parts[s], row)}"
    return source.row_where(i) if hasattr(source, "row_where") else f"{source.dataset_path}, row {int(i)}"


def validation_line(source, i: int, err: UserError, flag: str) -> str:
    """The one line of validation sample ``i`` that cannot be evaluated: the flag that named the set, that the
    sample is a validation one, its file and row, the image or clip file where one is to blame, and the reason."""
    where = validation_row(source, i)
    path = getattr(err, "path", None)  # a BadSampleError's image or clip file (a BadRowError's: the row)
    if path and path not in where and where not in path:
        where += f", {path}"
    reason = getattr(err, "reason", None) or re.sub(r"^sample -?\d+( of [^:]+)?: ", "", str(err))
    return f"{flag}: validation sample {i} ({where}): {reason}"


def shard_tokens(source: SFTSource, pre: SamplePreprocessor, indices, *,
                 flag: str) -> tuple[int, Optional[tuple[int, str]]]:
    """``(supervised tokens, first refusal)`` of the validation samples ``indices`` (ascending), after
    the chat template and truncation, as training counts them. A clip is planned as training plans it
    (``SamplePreprocessor.fitted_specs``: frames, video tokens, timestamps, fewer frames where it alone would
    not fit). The refusal is ``(sample, line)`` of the first sample that cannot be read (a UserError:
    placeholders, an unreadable header) or whose image or video tokens cannot fit; the scan stops there.
    Returned, not raised, so that a caller splitting the set over ranks can raise the lowest sample's line
    on every rank."""
    tokens = 0
    for i in indices:
        try:
            messages, refs = source[i]
            _specs, (ids, amask) = pre.fitted_specs(messages, refs, i)
        except UserError as err:
            return tokens, (i, validation_line(source, i, err, flag))
        vision = ((ids == pre.image_token_id) | (ids == pre.video_token_id)).nonzero()
        if len(vision) and int(vision[-1]) + 1 > pre.seq_length:
            return tokens, (i, f"{flag}: validation sample {i} ({validation_row(source, i)}) needs "
                               f"{int(vision[-1]) + 1} tokens for its images and clips, more than --seq-length "
                               f"{pre.seq_length}; raise --seq-length, lower --max-pixels (--video-max-pixels, "
                               f"--video-max-frames), or remove the sample (validation samples are never replaced)")
        last = min(len(ids) - 1, pre.seq_length)  # labels[t] = ids[t+1], as SamplePreprocessor.encode
        tokens += int(amask[1:last + 1].sum())
    return tokens, None


def no_supervised_tokens(flag: str, n_samples: int, seq_length: int) -> str:
    """The refusal of a validation set whose evaluated samples supervise nothing."""
    return (f"{flag}: the {n_samples} validation samples have no supervised tokens (no assistant text after the "
            f"chat template and --seq-length {seq_length}); check their roles (user/assistant) and --seq-length")


def check_validation_set(source: SFTSource, pre: SamplePreprocessor, n_samples: int, *, flag: str) -> int:
    """Supervised tokens of the first ``n_samples`` validation samples, in one process; refuses a set
    that has none or a sample that cannot fit (training splits this over its ranks: ``train.evaluate``)."""
    tokens, refused = shard_tokens(source, pre, range(n_samples), flag=flag)
    if refused is not None:
        raise UserError(refused[1])
    if tokens == 0:
        raise UserError(no_supervised_tokens(flag, n_samples, pre.seq_length))
    return tokens


class ValidationSampler(RankShare):
    """Per micro-batch, this rank's dataset indices of positions ``0..n_samples-1`` in dataset order
    (finite: ``ceil(n_samples / micro_batch_size)`` micro-batches). Filler positions past the end
    (the last micro-batch) are yielded as ``-1 - index`` of a real sample: read, but not counted."""

    def __init__(self, n_samples: int, *, micro_batch_size: int, dp_size: int, dp_rank: int,
                 whole_micro_batch: bool = False):
        assert n_samples > 0 and micro_batch_size % dp_size == 0 and 0 <= dp_rank < dp_size
        super().__init__(micro_batch_size, dp_size, dp_rank, whole_micro_batch)
        self.n = n_samples

    @property
    def micro_batches(self) -> int:
        return -(-self.n // self.mbs)

    def __len__(self) -> int:
        return self.micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(self.micro_batches):
            full = [p if p < self.n else -1 - (p % self.n) for p in range(k * self.mbs, (k + 1) * self.mbs)]
            yield self.share(full)


def uncounted_fillers(batch: dict, filler: list[bool], pad_id: int) -> dict:
    """Zero the loss of the filler rows of a collated micro-batch (``filler[b]`` for row b)."""
    if any(filler):
        rows = torch.tensor(filler, dtype=torch.bool)
        batch["loss_mask"][rows] = 0.0
        batch["labels"][rows] = pad_id
    return batch


class _ValidationBatches(torch.utils.data.Dataset):
    """Item = one rank-local validation micro-batch: the training set's ``MicroBatchDataset`` on the
    real indices, then the filler rows' loss zeroed."""

    def __init__(self, inner, keep_slice: tuple[int, int] | None, flag: str):
        self.inner, self.keep_slice, self.flag = inner, keep_slice, flag

    @property
    def max_bad_samples(self) -> int:
        """0: a validation sample is never replaced by a stand-in (the value would change)."""
        return self.inner.max_bad_samples

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, indices) -> dict:
        filler = [i < 0 for i in indices]
        batch = self.inner[[i if i >= 0 else -1 - i for i in indices]]
        if "input_ids" not in batch:  # a worker's UserError, passed on as data: say which validation row
            return {ERROR_KEY: self._named(indices, batch[ERROR_KEY])}
        if self.keep_slice is not None:
            filler = filler[self.keep_slice[0]: self.keep_slice[1]]
        return uncounted_fillers(batch, filler, self.inner.pre.pad_id)

    def _named(self, indices, line: str) -> str:
        """The line of the micro-batch's first sample that fails again when encoded alone (the error path
        only), as :func:`validation_line` writes it; the worker's own line where none does."""
        for i in sorted({i if i >= 0 else -1 - i for i in indices}):
            try:
                self.inner.encode(i)
            except UserError as err:
                return validation_line(self.inner.source, i, err, self.flag)
        return f"{self.flag}: {line}"


class ValidationReader:
    """This rank's validation micro-batches; iterate it once per evaluation (same samples each time).

    Workers (``--num-workers``) persist between evaluations; the loader has its own generator, so
    an evaluation never draws from the global torch RNG. ``flag``: the flag that named the set, for the
    line of a sample that cannot be evaluated (:func:`validation_line`).
    """

    def __init__(self, source: SFTSource, pre: SamplePreprocessor, *, n_samples: int, micro_batch_size: int,
                 dp_size: int, dp_rank: int, need_pixels: bool, scalable_dp: bool, num_workers: int,
                 pad_to_seq_length: bool, pixel_slice: tuple[int, int] | None = None, flag: str = "validation set"):
        self.sampler = ValidationSampler(n_samples, micro_batch_size=micro_batch_size, dp_size=dp_size,
                                         dp_rank=dp_rank, whole_micro_batch=not scalable_dp)
        keep = None if scalable_dp else self.sampler.slice  # without scalable DP: read all, keep this rank's part
        inner = MicroBatchDataset(source, pre, need_pixels=need_pixels, on_truncation="error",
                                  pad_to_seq_length=pad_to_seq_length, keep_slice=keep, pixel_slice=pixel_slice)
        self.dataset = _ValidationBatches(inner, keep, flag)
        self.loader = torch.utils.data.DataLoader(
            self.dataset, sampler=self.sampler, batch_size=None, collate_fn=identity, num_workers=num_workers,
            persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers > 0 else None,
            worker_init_fn=worker_init if num_workers > 0 else None, generator=torch.Generator().manual_seed(0))

    @property
    def micro_batches(self) -> int:
        return self.sampler.micro_batches

    def __iter__(self):
        """One pass: the ``micro_batches`` micro-batches, a worker's UserError raised as one line."""
        return MicroBatchIterator(self.loader, self.sampler, self.dataset)
