"""Metrics for people and machines, written by the rank that owns the language loss.

* ``StepMetrics``: the one record of a step; its fields are the ``metrics.jsonl`` keys (the
  per-module peak memory is one field written as ``peak_memory_bytes_<module>`` keys);
* people: a rich progress line per ``log_interval`` steps (step, loss, lr, step time, ETA);
* machines: ``metrics.jsonl`` (one JSON object per step, and one per evaluation with ``valid_loss``)
  and TensorBoard event files;
* the step's collectives every rank joins (peak memory per module, model FLOPs) and the model-FLOPs
  counter that gives each rank its share.

Other ranks construct a disabled logger so call sites need no rank checks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from typing import Iterable, Optional

from rich.console import Console

from mimo_sft.console import make_console
from mimo_sft.parallel.layout import LANGUAGE


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, as the metrics rank logs it. Field order is the JSON key order."""

    step: int
    loss: float
    grad_norm: Optional[float]
    lr: float
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    supervised_tokens: float
    vision_load_max_over_mean_before: Optional[float]
    vision_load_max_over_mean_after: Optional[float]
    #: share of the language positions computed this step that are padding (0 with --in-batch-packing)
    padding_fraction: float
    #: the background exchange's own wall time (overlapped: mostly off the critical path)
    reorder_exchange_s: float
    #: how long the training loop was blocked waiting for reordered micro-batches (on the critical path)
    reorder_wait_s: float
    data_wait_s: float
    #: sample bytes the reorder exchange sent between ranks this step, all ranks (0 with --reorder-mode index)
    reorder_bytes: float
    #: images decoded this step, summed over every rank (a colocated layout may decode one image on several)
    images_decoded: int
    #: bad samples (an unreadable image or clip, a row that cannot be trained on) first met this step over all ranks
    #: and replaced by a stand-in (--max-bad-samples; train.bad_samples): each sample counted once in the run
    bad_samples_skipped: int
    #: clip frames decoded this step, summed over every rank, and the loader workers' seconds decoding, resizing
    #: and cutting those samples (worker time, off the training thread when workers run ahead)
    video_frames_decoded: int
    video_decode_s: float
    #: largest over all ranks (GPU: device memory since the step began; CPU: peak resident set size)
    peak_memory_bytes: int
    #: largest over each module's ranks; written as ``peak_memory_bytes_<module>``
    peak_memory_bytes_by_module: dict = field(metadata={"flatten_as": "peak_memory_bytes_"})
    model_flops: float
    model_tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    update_ok: bool
    consumed_samples: int
    #: ranks of the layout that ran this step (a run resumed on another layout changes it: ``mimo-sft summarize``)
    world_size: int
    #: samples of this step whose supervised answer was cut at --seq-length
    truncated_samples: int = 0
    #: samples of this step with an assistant turn that has no text (trained on the end-of-turn token alone)
    empty_answers: int = 0
    #: a mixture-of-experts model's routing figures (``train.expert_load``), written as they are named; empty
    #: for a dense model
    moe: dict = field(default_factory=dict, metadata={"flatten_as": "", "per_module": False})
    #: a dataset mixture's per-source figures, written as ``loss/<name>``, ``tokens/<name>`` (supervised) and
    #: ``samples/<name>``; ``loss/<name>`` absent in a step without that source's tokens; empty for one dataset
    sources: dict = field(default_factory=dict, metadata={"flatten_as": "", "per_module": False})
    #: a colocated run with reordering: each GPU's whole load (its vision slice plus its share of its language DP
    #: rank, as the plan weighs them), max over mean, before and after the plan (``gpu_load_max_over_mean_*``);
    #: with --encoder-balance, the images moved and the towers' patches max over mean before and after the moves
    #: (``encoder_balance_moved_images``, ``encoder_balance_max_over_mean_*``; ``train.encoder_balance``)
    gpus: dict = field(default_factory=dict, metadata={"flatten_as": "", "per_module": False})
    #: at a log step of a run of several ranks, the straggler report's per-rank figures (``train.straggler``):
    #: ``rank_step_s``, ``rank_work_s``, ``rank_phase_s``, ``rank_patches``, ``rank_tokens``; ``slowest_rank``, ``slowest_excess``, ``slowest_phase``
    #: where a rank has peers; empty at other steps
    ranks: dict = field(default_factory=dict, metadata={"flatten_as": "", "per_module": False})

    def to_json(self) -> dict:
        """The ``metrics.jsonl`` object: every field, dict fields flattened to ``<prefix><key>``."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            prefix = f.metadata.get("flatten_as")
            if prefix is None:
                out[f.name] = value
            else:
                out.update({f"{prefix}{k}": v for k, v in value.items()})
        return out

    @classmethod
    def json_keys(cls, modules: Iterable[str]) -> list[str]:
        """The ``metrics.jsonl`` keys of a run whose layout has ``modules``."""
        keys = []
        for f in fields(cls):
            prefix = f.metadata.get("flatten_as")
            if not f.metadata.get("per_module", True):
                continue  # keys of their own (a dense model's run has none)
            keys += [f.name] if prefix is None else [f"{prefix}{m}" for m in modules]
        return keys


class ModelFlopsCounter:
    """Model FLOPs (forward + backward) of the micro-batches this rank counts, per step.

    Each sample's work is counted on exactly one rank, so the sum over all ranks is the step's model
    FLOPs: its language work on the language tp/cp/pp rank 0 of its DP rank, its vision work on its
    encoder tp rank 0. Padded positions are computed, so they count; with ``packed`` (in-batch packing)
    only the real tokens are computed, as sequences of their real lengths.
    """

    def __init__(self, hf_config, padded_vocab: int, *, count_language: bool, count_vision: bool,
                 packed: bool = False):
        self.hf_config = hf_config
        self.padded_vocab = padded_vocab
        self.count_language = count_language
        self.count_vision = count_vision
        self.packed = packed
        self.step_flops = 0.0

    @classmethod
    def for_rank(cls, layout, rank: int, model_info, *, packed: bool = False) -> "ModelFlopsCounter":
        coords = layout.coords(rank)
        lang = coords.get(LANGUAGE)
        return cls(model_info.hf_config, model_info.padded_vocab_size,
                   count_language=lang is not None and lang.tp == 0 and lang.cp == 0 and lang.pp == 0,
                   count_vision=any(coords.get(s.name) is not None and coords[s.name].tp == 0 for s in layout.encoders),
                   packed=packed)

    def start_step(self) -> None:
        self.step_flops = 0.0

    def count(self, batch: dict) -> None:
        if not (self.count_language or self.count_vision) or self.hf_config is None:
            return
        from mimo_sft.train.flops import training_flops

        ids = batch["input_ids"]
        grids = batch.get("image_grid_thw") if self.count_vision else None
        if grids is not None and grids.numel():  # a clip's carried grid counts frames: the model's counts patches
            from mimo_sft.model.pixels import model_grid_thw

            grids = model_grid_thw(grids, int(getattr(self.hf_config.vision_config, "temporal_patch_size", 2)))
        if not self.count_language:
            lengths = []
        elif self.packed:
            lengths = [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]
        else:
            lengths = [ids.shape[1]] * ids.shape[0]
        f = training_flops(self.hf_config, lengths,
                           grids.tolist() if grids is not None and grids.numel() else None, vocab_size=self.padded_vocab)
        self.step_flops += f.total


def step_model_flops(local_flops: float, pstate, extra: tuple[float, ...] = ()) -> float | tuple[float, ...]:
    """The step's model FLOPs: the sum of every rank's counted share (collective, every rank).
    ``extra``: more per-rank figures summed in the same all-reduce; then returns all the sums."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([local_flops, *extra], dtype=torch.float64)
    dist.all_reduce(t, group=pstate.world_gloo)
    return tuple(t.tolist()) if extra else float(t[0])


def throughput(step_flops: float, step_time_s: float, world_size: int,
               peak_tflops: float | None) -> tuple[Optional[float], Optional[float]]:
    """``(model_tflops_per_gpu, mfu)``; ``mfu`` is a fraction, None without a known peak (e.g. on CPU)."""
    from mimo_sft.train.flops import achieved_tflops_per_gpu, mfu

    achieved = achieved_tflops_per_gpu(step_flops, step_time_s, world_size)
    return achieved, mfu(achieved, peak_tflops)


def peak_memory_by_module(pstate) -> dict[str, int]:
    """This step's peak memory per module: the largest over that module's ranks (collective, every rank).

    GPU: device memory since the step began; CPU: the process's peak resident set size, which
    cannot be reset. The step's overall peak is the largest of these values.
    """
    import torch
    import torch.distributed as dist

    from mimo_sft.parallel import runtime

    names = list(pstate.modules)
    mine = runtime.peak_memory_bytes()
    t = torch.tensor([mine if pstate.modules[n].member else 0 for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pstate.world_gloo)
    return {n: int(v) for n, v in zip(names, t.tolist())}


class AnswerTally:
    """Run totals of the silent data changes (answers cut at --seq-length, empty answers), said once
    when first met and summed up when the run ends, each with the first dataset index that had it."""

    KINDS = (("truncated", "answer(s) cut at --seq-length {seq}", "raise --seq-length to keep them whole"),
             ("empty", "sample(s) with an empty assistant answer (trained on the end-of-turn token alone)",
              "fill in or drop those rows"))

    def __init__(self, seq_length: int, *, enabled: bool):
        self.seq_length, self.enabled = seq_length, enabled
        self.totals = {"truncated": 0, "empty": 0}
        self.first = {"truncated": -1, "empty": -1}

    def add(self, step: int, counts: dict[str, int], firsts: dict[str, int]) -> None:
        for kind, what, fix in self.KINDS:
            if counts[kind] <= 0:
                continue
            if self.totals[kind] == 0 and self.enabled:
                key = "truncated_samples" if kind == "truncated" else "empty_answers"
                print(f"mimo-sft: note: step {step} has {counts[kind]} {what.format(seq=self.seq_length)} (first: sample "
                      f"{firsts[kind]}); counted per step in metrics.jsonl as {key}; {fix}", flush=True)
            self.totals[kind] += counts[kind]
            if self.first[kind] < 0 or 0 <= firsts[kind] < self.first[kind]:
                self.first[kind] = firsts[kind]

    def summary(self) -> str | None:
        parts = [f"{self.totals[k]} {what.format(seq=self.seq_length)} (first: sample {self.first[k]})"
                 for k, what, _fix in self.KINDS if self.totals[k]]
        return "mimo-sft: data over the run: " + "; ".join(parts) if parts else None


def cut_after(path: str, step: int) -> None:
    """Keep the rows of ``path`` (metrics.jsonl) up to ``step``: a run resumed at ``step`` in the folder of one
    that went further (killed after its last checkpoint, then requeued) logs those steps again, once. Atomic."""
    if not os.path.isfile(path):
        return
    with open(path) as fh:
        lines = fh.readlines()
    kept = []
    for line in lines:
        try:
            row_step = json.loads(line).get("step")
        except ValueError:
            continue  # a line cut by the kill
        if row_step is None or row_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            fh.writelines(kept)
        os.replace(tmp, path)


class MetricsLogger:
    def __init__(self, output_dir: str, *, enabled: bool, total_steps: int, log_interval: int = 1,
                 tensorboard: bool = True, console: Console | None = None, trackers: list | None = None,
                 resume_step: int | None = None):
        self.enabled = enabled
        #: ``train.trackers`` (W&B, MLflow): each gets every row written to metrics.jsonl
        self.trackers = list(trackers or []) if enabled else []
        self.total_steps = total_steps
        self.log_interval = max(1, log_interval)
        self.console = console or make_console(highlight=False, soft_wrap=True)
        self._tb = None
        self._fh = None
        self._t0 = time.perf_counter()
        self._steps_timed = 0
        self._step_times: list[float] = []  # each step's own time after the first (its warm-up): the ETA's pace
        #: keys the first step row this logger writes carries besides the step's own (the trainer's ``startup_*``)
        self.first_row: dict = {}
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is not None:  # a resumed run (or one restarted from scratch by --load-checkpoint auto)
            cut_after(self.path, resume_step)
        self._fh = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run's events replace those a killed run wrote after its checkpoint
                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                         purge_step=resume_step + 1 if resume_step else None)
            except ImportError:  # tensorboard is in requirements; keep training if it is absent
                self.console.print("[yellow]tensorboard not installed: no event files[/yellow]")

    def log(self, record: StepMetrics) -> None:
        if not self.enabled:
            return
        row = record.to_json()
        if self.first_row:
            row.update(self.first_row)
            self.first_row = {}
        self.write_row(row, record.step)
        self._steps_timed += 1
        if self._steps_timed > 1:
            self._step_times.append(record.step_time_s)
        step = record.step
        if step % self.log_interval == 0 or step == self.total_steps:
            eta = self.eta_s(step)
            before, after = record.vision_load_max_over_mean_before, record.vision_load_max_over_mean_after
            load = ""
            gpus = record.gpus
            if "gpu_load_max_over_mean_before" in gpus:  # colocated: what gates the step is the whole GPU
                after_gpu = gpus.get("gpu_load_max_over_mean_after")
                load = (f" | GPU load max/mean {gpus['gpu_load_max_over_mean_before']:.3f}"
                        + (f" -> {after_gpu:.3f}" if after_gpu is not None else ""))
            elif before is not None:
                load = f" | vision load max/mean {before:.3f}" + (f" -> {after:.3f}" if after is not None else "")
            if "encoder_balance_max_over_mean_before" in gpus:  # --encoder-balance: the towers after the image moves
                load += (f" | towers max/mean {gpus['encoder_balance_max_over_mean_before']:.3f} -> "
                         f"{gpus.get('encoder_balance_max_over_mean_after', float('nan')):.3f}")
            mfu = f" | MFU {100 * record.mfu:.1f}%" if record.mfu is not None else ""
            if "moe_load_max_over_mean" in record.moe:
                load += f" | experts max/mean {record.moe['moe_load_max_over_mean']:.2f}"
            if "slowest_rank" in record.ranks:  # the straggler report: work over its peers' median, and where
                r = record.ranks
                load += f" | slowest rank {r['slowest_rank']} {100 * r['slowest_excess']:+.0f} % ({r['slowest_phase']})"
            self.console.print(
                f"step {step:>5}/{self.total_steps} | loss {record.loss:.4f} | lr {record.lr:.2e} | "
                f"grad norm {record.grad_norm:.3f} | {record.step_time_s:.2f} s/step | "
                f"{record.tokens_per_s:.0f} tok/s{mfu}{load} | ETA {eta:.0f} s"
            )

    def eta_s(self, step: int) -> float:
        """Seconds left at the pace of the training steps (the median of their own times, the first's warm-up
        left out): a checkpoint save or an evaluation between steps does not make it jump. Before a second step,
        the wall time so far."""
        left = max(0, self.total_steps - step)
        if not self._step_times:
            return (time.perf_counter() - self._t0) / max(self._steps_timed, 1) * left
        recent = sorted(self._step_times[-50:])
        return recent[len(recent) // 2] * left

    def write_row(self, row: dict, step: int, *, tb_section: str = "train") -> None:
        """One row for machines: a ``metrics.jsonl`` line, TensorBoard scalars under ``tb_section/``,
        and every tracker."""
        self._fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{tb_section}/{key}", value, step)
        for tracker in self.trackers:
            tracker.log_metrics(row, step)
    def log_validation(self, result) -> None:
        """One ``metrics.jsonl`` row for an evaluation (``train.evaluate.EvalResult``: ``step`` is the
        step it follows, 0 before the first), ``valid/*`` TensorBoard scalars and a progress line."""
        if not self.enabled:
            return
        row = result.to_json()
        self._fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            # the whole set's loss and perplexity, and a mixture's per-source ``valid_loss/<name>``, ``valid_tokens/<name>``
            for key in ("valid_loss", "valid_ppl") + tuple(k for k in row if k.startswith(("valid_loss/", "valid_tokens/"))):
                self._tb.add_scalar(f"valid/{key[len('valid_'):]}", row[key], result.step)
        for tracker in self.trackers:  # the trackers get the same row (valid_loss, valid_ppl, ...)
            tracker.log_metrics(row, result.step)
        self.console.print(
            f"validation after step {result.step:>5} | valid loss {result.valid_loss:.4f} | "
            f"valid ppl {result.valid_ppl:.3f} | {result.valid_tokens:.0f} tokens in {result.valid_samples} samples | "
            f"{result.valid_time_s:.2f} s")

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self._fh:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
