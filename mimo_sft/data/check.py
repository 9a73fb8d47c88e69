"""``mimo-sft check-data``: decode every sample once, exactly as training would, and list what is wrong.

Why: start-up checks only that image files exist and ``plan`` reads the headers of a few
micro-batches, so a truncated JPEG or a placeholder mismatch at row 6 million stops a run hours in.
This runs the training path itself (``SFTSource[i]`` -> ``SamplePreprocessor.encode`` with pixels:
chat template, placeholders, truncation, image decode and RGB conversion) on every row, in worker
processes, and collects instead of raising: every problem with its sample index and file, and counts
of what training would silently change (answers cut at ``--seq-length``, empty answers, images
resized because they are over ``--max-pixels`` or under ``--min-pixels``, image tokens past
``--seq-length``, text-only rows).

Workers get chunks of indices and send back one small ``ChunkReport`` each, so memory stays flat in
the number of rows; nothing is kept per good sample.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from mimo_sft.config.mixture import dataset_label
from mimo_sft.errors import BadSampleError, UserError

COUNT_KEYS = ("samples", "images", "clips", "clip_frames", "clips_downsampled", "text_only", "truncated_answers",
              "empty_answers", "images_over_max_pixels", "images_under_min_pixels", "image_tokens_past_seq_length",
              "bad_samples")


@dataclass
class SampleProblem:
    index: int
    path: str | None
    reason: str

    def __str__(self) -> str:
        return str(BadSampleError(self.index, self.path, self.reason))


@dataclass
class ChunkReport:
    """Counts and problems of one chunk of samples (what a worker sends back)."""

    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))
    problems: list = field(default_factory=list)
    first: dict = field(default_factory=dict)  # count key -> smallest sample index that had it
    #: ``--write-costs``: (first index, ``[rows, 2]`` int32 real tokens and image tokens, ``[images, 4]`` int32 row,
    #: t, h, w of every image and clip; ``data.cost_file``)
    costs: list = field(default_factory=list)

    def add(self, other: "ChunkReport") -> None:
        for k, v in other.counts.items():
            self.counts[k] += v
        self.problems.extend(other.problems)
        self.costs.extend(other.costs)
        for k, i in other.first.items():
            self.first[k] = min(i, self.first.get(k, i))

    def flag(self, key: str, index: int, n: int = 1) -> None:
        self.counts[key] += n
        self.first.setdefault(key, index)


class _CheckDataset:
    """Item k = the report of the k-th chunk of sample indices (a torch Dataset in shape)."""

    def __init__(self, source, pre, n: int, chunk: int, costs: bool = False):
        self.source, self.pre, self.n, self.chunk, self.costs = source, pre, n, chunk, costs

    def __len__(self) -> int:
        return (self.n + self.chunk - 1) // self.chunk

    def __getitem__(self, k: int) -> ChunkReport:
        import numpy as np

        from mimo_sft.data.cost_file import UNKNOWN

        report = ChunkReport()
        lo, hi = k * self.chunk, min(self.n, (k + 1) * self.chunk)
        block = np.full((hi - lo, 2), UNKNOWN, dtype=np.int32) if self.costs else None
        grids = []
        for i in range(lo, hi):
            counts = check_sample(self.source, self.pre, i, report)
            if block is not None and counts is not None:
                block[i - lo] = counts[:2]
                grids.extend((i, *g) for g in counts[2])
        if block is not None:
            report.costs.append((lo, block, np.array(grids, dtype=np.int32).reshape(-1, 4)))
        return report


def check_sample(source, pre, i: int, report: ChunkReport) -> tuple[int, int, list] | None:
    """Decode sample ``i`` as training does; count what it changes, or record why it cannot train.
    Returns its ``(real tokens, image tokens, grids)`` (``DROPPED``: its image tokens pass --seq-length;
    None: it could not be encoded; ``grids``: each image's and clip's ``(t, h, w)`` in patches), what a
    cost file holds (``data.cost_file``)."""
    from mimo_sft.data.cost_file import DROPPED
    from mimo_sft.data.image_refs import VideoRef
    from mimo_sft.data.images import image_where, open_sample_image
    from mimo_sft.data.preprocess import TruncatedImageError

    report.counts["samples"] += 1
    refs: list = []
    try:
        messages, refs = source[i]
        for ref in refs:
            if isinstance(ref, VideoRef):  # a clip: its header, frames and pixels are read by encode below
                continue
            w, h = open_sample_image(ref, i, max_image_pixels=pre.max_image_pixels).size
            if w * h > pre.max_pixels:
                report.flag("images_over_max_pixels", i)
            elif w * h < pre.min_pixels:
                report.flag("images_under_min_pixels", i)
        sample = pre.encode(messages, refs, i, need_pixels=True)
    except TruncatedImageError as err:
        report.flag("image_tokens_past_seq_length", i)
        report.problems.append(SampleProblem(i, None, f"its image tokens end at token {err.needed} but "
                                                      f"--seq-length is {err.seq_length}; training drops it "
                                                      f"(--on-truncation drop) or stops (error)"))
        return DROPPED, 0, []
    except BadSampleError as err:
        report.flag("bad_samples", i)
        report.problems.append(SampleProblem(i, err.path, err.reason))
        return
    except UserError as err:
        report.flag("bad_samples", i)
        reason = re.sub(rf"^sample {i}( of [^:]+)?: ", "", str(err))  # the listing names the sample already
        report.problems.append(SampleProblem(i, None, reason))
        return
    except Exception as err:  # noqa: BLE001 - a decoder's own error on a bad file is a finding, not a crash
        report.flag("bad_samples", i)
        path = next((w for r in refs if (w := r.where() if isinstance(r, VideoRef) else image_where(r))), None)
        report.problems.append(SampleProblem(i, path, f"{type(err).__name__}: {str(err).strip()[:200]}"))
        return
    report.counts["images"] += len(refs) - len(sample["clips"])
    for frames, downsampled in sample["clips"]:
        report.counts["clips"] += 1
        report.counts["clip_frames"] += frames
        if downsampled:  # more frames or pixels than --seq-length (or --video-total-pixels) leaves
            report.flag("clips_downsampled", i)
    if not refs:
        report.flag("text_only", i)
    if sample["answer_cut"]:
        report.flag("truncated_answers", i)
    if sample["answer_empty"]:
        report.flag("empty_answers", i)
    ids = sample["input_ids"]
    # clips' tokens are image tokens to the model
    return len(ids), int((ids == pre.image_token_id).sum()), [tuple(int(x) for x in g) for g in sample["grids"]]


def _identity(x):
    return x


def _worker_init(_worker_id: int) -> None:
    import torch

    torch.set_num_threads(1)


def check_dataset(data_cfg, *, model_dir, workers: int, chunk: int = 256, write_costs: bool = False,
                  progress=None) -> dict:
    """Every sample of ``data_cfg``'s dataset checked; a JSON-ready dict of counts and problems.
    ``write_costs``: also write each source's reordering counts to ``--cost-dir`` (``data.cost_file``).
    ``progress(done, total)``: called as each chunk of samples is checked."""
    import numpy as np
    import torch

    from mimo_sft.data.cost_file import UNKNOWN, cost_dir, write_cost_files

    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset

    source = load_sft_dataset(data_cfg, check_files=False)  # missing files are listed below, every one
    pre = build_preprocessor(data_cfg, model_dir)
    ds = _CheckDataset(source, pre, len(source), chunk, costs=write_costs)
    if workers <= 0:
        items = (ds[k] for k in range(len(ds)))
    else:
        items = iter(torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=_identity, num_workers=workers,
                                                 worker_init_fn=_worker_init))
    total = ChunkReport()
    counts = np.full((len(source), 2), UNKNOWN, dtype=np.int32) if write_costs else None
    grids = []
    for item in items:
        for lo, block, images in item.costs:  # into place as chunks arrive: memory is the two columns and the grids
            counts[lo:lo + len(block)] = block
            grids.append(images)
        item.costs = []
        total.add(item)
        if progress is not None:
            progress(total.counts["samples"], len(source))
    files = write_cost_files(source, pre, counts[:, 0], counts[:, 1], cost_dir(data_cfg),
                             grids=np.concatenate(grids) if grids else None) if write_costs else []
    return {
        "cost_files": files,
        "ok": not total.problems,
        "dataset": dataset_label(data_cfg),
        "seq_length": pre.seq_length,
        "min_pixels": pre.min_pixels,
        "max_pixels": pre.max_pixels,
        "image_backend": pre.image_backend,
        "video": {"fps": pre.clips.fps, "min_frames": pre.clips.min_frames, "max_frames": pre.clips.max_frames,
                  "min_pixels": pre.clips.min_pixels, "max_pixels": pre.clips.max_pixels}
        if total.counts["clips"] else None,
        "counts": total.counts,
        "first_sample": total.first,
        "problems": [asdict(p) for p in total.problems],
    }
