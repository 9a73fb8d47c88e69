"""What happens after a training step's optimizer step: its collectives, then the metrics rank's record.

Every rank joins the same collectives in the same order, decided from the config alone, so they stay matched:
peak memory per module, then one world all-reduce that carries the model FLOPs, the feed's counters, the bad
samples each rank met first (``train.bad_samples``: then gathered, on a step that has any) and, every
``--log-interval`` steps, the straggler report's per-rank block (``train.straggler``); the vision-load and
expert-load figures; and on the last language pipeline stage the host counts over its DP group.

The loss stays on the device (a GPU would wait for the whole step to read it): each step's record waits in
:class:`PendingRows` with its loss sums, and every ``--log-interval`` steps (at the last step, and before an
evaluation or a stop) the last language stage reduces the waiting sums over its DP group in one device
all-reduce and reads them in one ``tolist()``; every record is then written with its own loss and, on a GPU,
its own step time from CUDA events (``parallel.runtime.StepClock``). A non-finite loss stops the run there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import LANGUAGE
from mimo_sft.train.metrics import StepMetrics, peak_memory_by_module, step_model_flops, throughput

#: how many figures of the world all-reduce come before the straggler block
_COUNTERS = 5


@dataclass
class _Pending:
    record: StepMetrics  # every figure but the loss, the per-source losses and (on a GPU) the time
    sums: torch.Tensor  # [loss sum, tokens, per-source loss sums..., per-source tokens...] on the device
    clock: object  # parallel.runtime.StepClock
    samples: float  # for samples/s
    real_tokens: float  # for tokens/s
    sources: dict  # the per-source host figures (samples, epochs)


class PendingRows:
    """Step records waiting for their device losses (module docstring); the last language stage's."""

    def __init__(self):
        self.rows: list[_Pending] = []

    def add(self, row: _Pending) -> None:
        self.rows.append(row)

    def flush(self, tr) -> None:
        """Reduce and read every waiting row's sums (one device all-reduce, one host read), then log each row."""
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        stacked = torch.stack([r.sums for r in rows])
        group = tr.pstate.modules[LANGUAGE].pg_collection.dp_cp  # under cp each rank holds its positions' sums
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stacked, group=group)
        values = stacked.tolist()  # the interval's one host read
        names = tr.feed.mixture.names if tr.feed.mixture is not None else []
        for row, sums in zip(rows, values):
            loss = sums[0] / max(sums[1], 1.0)
            if not math.isfinite(loss):
                raise UserError(f"loss became {loss} at step {row.record.step}; lower --lr or check the data")
            step_time = row.clock.seconds()
            tflops, mfu = throughput(row.record.model_flops, step_time, tr.layout.world_size, tr.peak_tflops)
            tr.logger.log(replace(row.record, loss=loss, step_time_s=step_time, tokens_per_s=row.real_tokens / step_time,
                                  samples_per_s=row.samples / step_time, model_tflops_per_gpu=tflops, mfu=mfu,
                                  sources=_source_losses(names, sums[2:], row.sources)))


def _source_losses(names: list, sums: list, host: dict) -> dict:
    """``loss/<name>`` (where the source had tokens) and ``tokens/<name>`` from the reduced sums, with the host figures."""
    out, n = {}, len(names)
    for i, name in enumerate(names):
        loss_sum, tokens = sums[i], sums[n + i]
        if tokens > 0:
            out[f"loss/{name}"] = loss_sum / tokens
        out[f"tokens/{name}"] = tokens
        out[f"samples/{name}"], out[f"epochs/{name}"] = host[f"samples/{name}"], host[f"epochs/{name}"]
    return out


def log_step(tr, result) -> None:
    """After ``result`` (``train.trainer.StepResult``) of trainer ``tr``: the collectives, then (metrics rank)
    the step's record, written at the log interval with its loss (:class:`PendingRows`)."""
    peaks = peak_memory_by_module(tr.pstate)
    c = tr.feed.end_step()
    tr.straggler.add(result.step_time_s, result.phase_s, (encoded_patches(tr, c.vision_patches), c.language_share))
    block = tr.straggler.figures(tr.step)
    model_flops, *summed = step_model_flops(
        tr.feed.flops.step_flops, tr.pstate,
        (c.reorder_bytes, c.images_decoded, tr.bad_samples.local_count(), c.video_frames_decoded, c.video_decode_s,
         *block))
    reorder_bytes, images, bad_met, frames, video_s = summed[:_COUNTERS]
    bad = tr.bad_samples.merge(bad_met)  # every rank: the distinct samples, the same refusal past the limit
    load = tr.feed.load_stats
    before, after = load.step_figures() if load is not None else (None, None)
    moe = tr.expert_load.step_figures(tr.pstate.world_gloo) if tr.expert_load is not None else {}
    balanced = encoder_figures(tr)  # every rank takes them (they pile up otherwise); the metrics rank logs them
    if not tr.is_last_language_stage:
        return
    n_src = tr.runner.n_sources  # a mixture: per-source samples after the 6 figures
    t = torch.tensor([tr.feed.step_loss_tokens(), c.real_tokens, float(c.samples), c.computed_positions,
                      c.truncated_samples, c.empty_answers, *(c.source_samples or [0] * n_src)], dtype=torch.float64)
    no_index = float(2 ** 62)  # "none seen" for the MIN reduction of the first flagged sample
    firsts = torch.tensor([c.first_truncated if c.first_truncated >= 0 else no_index,
                           c.first_empty if c.first_empty >= 0 else no_index], dtype=torch.float64)
    lang_dp = tr.pstate.modules[LANGUAGE].dp_gloo
    if lang_dp is not None and dist.get_world_size(lang_dp) > 1:
        dist.all_reduce(t, group=lang_dp)
        dist.all_reduce(firsts, op=dist.ReduceOp.MIN, group=lang_dp)
    tr.answers.add(tr.step, {"truncated": int(t[4]), "empty": int(t[5])},
                   {"truncated": int(firsts[0]), "empty": int(firsts[1])})
    ranks = tr.straggler.analyse(tr.step, summed[_COUNTERS:]) if tr.logger.enabled else {}
    record = StepMetrics(
        step=tr.step, loss=math.nan, grad_norm=result.grad_norm, lr=result.lr, step_time_s=result.step_time_s,
        tokens_per_s=0.0, samples_per_s=0.0, supervised_tokens=float(t[0]),
        vision_load_max_over_mean_before=before, vision_load_max_over_mean_after=after,
        padding_fraction=1.0 - float(t[1]) / max(float(t[3]), 1.0),
        reorder_exchange_s=c.exchange_s, reorder_wait_s=c.reorder_wait_s, data_wait_s=c.data_wait_s,
        reorder_bytes=reorder_bytes, images_decoded=int(images), bad_samples_skipped=int(bad),
        video_frames_decoded=int(frames), video_decode_s=float(video_s),
        peak_memory_bytes=max(peaks.values()), peak_memory_bytes_by_module=peaks,
        model_flops=model_flops, model_tflops_per_gpu=None, mfu=None,
        update_ok=result.update_ok, consumed_samples=tr.consumed, world_size=tr.layout.world_size,
        truncated_samples=int(t[4]), empty_answers=int(t[5]), moe=moe,
        gpus={**(load.gpu_figures() if load is not None else {}), **balanced}, ranks=ranks)
    tr.pending_rows.add(_Pending(record, _device_sums(result.output, n_src), result.clock, float(t[2]), float(t[1]),
                                 source_host_figures(tr, t[6:])))
    if tr.step % tr.cfg.logging.log_interval == 0 or tr.step == tr.cfg.train.train_iters:
        tr.pending_rows.flush(tr)


def _device_sums(output, n_sources: int) -> torch.Tensor:
    """``[loss sum, tokens, per-source loss sums, per-source tokens]`` of the step, on the device."""
    parts = [output.sums]
    if n_sources:
        parts.append(output.source_sums.reshape(-1) if output.source_sums is not None
                     else output.sums.new_zeros(2 * n_sources))
    return torch.cat(parts)


def encoded_patches(tr, handed: float) -> float:
    """The patches this rank's tower encoded this step: with ``--encoder-balance`` what the plan sent it, with a
    tower replicated over tp ranks its share (``train.tower_split``), else the slice it was handed."""
    from mimo_sft.train import tower_split

    split = tower_split.take_encoded_patches()
    encoded = None
    if tr.cfg.reorder.encoder_balance:
        from mimo_sft.train.encoder_balance import take_encoded_patches

        encoded = take_encoded_patches()
    encoded = encoded if split is None else split  # the replicas share what the balance sent their tower
    return handed if encoded is None else encoded


def encoder_figures(tr) -> dict:
    """``--encoder-balance``'s figures of the step (the plan every vision rank computed alike; no collective)."""
    if not tr.cfg.reorder.encoder_balance:
        return {}
    from mimo_sft.train.encoder_balance import take_step_figures

    return take_step_figures()


def source_host_figures(tr, samples: torch.Tensor) -> dict:
    """``samples/<name>`` from the reduced per-source sample counts, and ``epochs/<name>``: how many times the
    source has been read so far (from the interleave, no collective); the losses follow at the flush."""
    mixture = tr.feed.mixture
    if mixture is None:
        return {}
    if tr.mixture_order is None:
        tr.mixture_order = mixture.order(seed=tr.cfg.train.seed, shuffle=False)
    out = {}
    for i, (name, epochs) in enumerate(zip(mixture.names, mixture.epochs(tr.mixture_order, tr.consumed))):
        out[f"samples/{name}"], out[f"epochs/{name}"] = int(samples[i]), round(epochs, 6)
    return out

