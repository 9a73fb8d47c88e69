"""What happens after a training step's optimizer step: its collectives, then the metrics rank's record.

Every rank joins the same collectives in the same order, decided from the config alone, so they stay matched:
peak memory per module, then one world all-reduce that carries the model FLOPs, the feed's counters, the bad
samples each rank met first (``train.bad_samples``: then gathered, on a step that has any) and, every
``--log-interval`` steps, the straggler report's per-rank block (``train.straggler``); the vision-load and
expert-load figures; and on the last language pipeline stage the loss and token sums over its DP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo_sft.errors import UserError
from mimo_sft.parallel.layout import LANGUAGE
from mimo_sft.train.metrics import StepMetrics, peak_memory_by_module, step_model_flops, throughput

#: how many figures of the world all-reduce come before the straggler block
_COUNTERS = 5


def log_step(tr, result) -> None:
    """After ``result`` (``train.trainer.StepResult``) of trainer ``tr``: the collectives, then (metrics rank)
    one ``StepMetrics`` record; a non-finite loss stops the run (every last-stage language rank raises)."""
    peaks = peak_memory_by_module(tr.pstate)
    c = tr.feed.end_step()
    tr.straggler.add(result.step_time_s, result.phase_s, (c.vision_patches, c.language_share))
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
    out = result.output
    n_src = tr.runner.n_sources  # a mixture: per-source loss sums, tokens, samples after the 7 figures
    sums = tr.runner.source_sums or [[0.0] * n_src, [0.0] * n_src]
    t = torch.tensor([out.loss_sum, out.num_tokens, c.real_tokens, float(c.samples), c.computed_positions,
                      c.truncated_samples, c.empty_answers, *sums[0], *sums[1],
                      *(c.source_samples or [0] * n_src)], dtype=torch.float64)
    no_index = float(2 ** 62)  # "none seen" for the MIN reduction of the first flagged sample
    firsts = torch.tensor([c.first_truncated if c.first_truncated >= 0 else no_index,
                           c.first_empty if c.first_empty >= 0 else no_index], dtype=torch.float64)
    lang_dp = tr.pstate.modules[LANGUAGE].dp_gloo
    if lang_dp is not None and dist.get_world_size(lang_dp) > 1:
        dist.all_reduce(t, group=lang_dp)
        dist.all_reduce(firsts, op=dist.ReduceOp.MIN, group=lang_dp)
    tr.answers.add(tr.step, {"truncated": int(t[5]), "empty": int(t[6])},
                   {"truncated": int(firsts[0]), "empty": int(firsts[1])})
    loss = float(t[0] / max(t[1], 1.0))
    if not torch.isfinite(torch.tensor(loss)):
        raise UserError(f"loss became {loss} at step {tr.step}; lower --lr or check the data")
    step_time = result.step_time_s
    tflops, mfu = throughput(model_flops, step_time, tr.layout.world_size, tr.peak_tflops)
    ranks = tr.straggler.analyse(tr.step, summed[_COUNTERS:]) if tr.logger.enabled else {}
    tr.logger.log(StepMetrics(
        step=tr.step, loss=loss, grad_norm=result.grad_norm, lr=result.lr, step_time_s=step_time,
        tokens_per_s=float(t[2]) / step_time, samples_per_s=float(t[3]) / step_time,
        supervised_tokens=float(t[1]),
        vision_load_max_over_mean_before=before, vision_load_max_over_mean_after=after,
        padding_fraction=1.0 - float(t[2]) / max(float(t[4]), 1.0),
        reorder_exchange_s=c.exchange_s, reorder_wait_s=c.reorder_wait_s, data_wait_s=c.data_wait_s,
        reorder_bytes=reorder_bytes, images_decoded=int(images), bad_samples_skipped=int(bad),
        video_frames_decoded=int(frames), video_decode_s=float(video_s),
        peak_memory_bytes=max(peaks.values()), peak_memory_bytes_by_module=peaks,
        model_flops=model_flops, model_tflops_per_gpu=tflops, mfu=mfu,
        update_ok=result.update_ok, consumed_samples=tr.consumed, world_size=tr.layout.world_size,
        truncated_samples=int(t[5]), empty_answers=int(t[6]), moe=moe,
        gpus={**(load.gpu_figures() if load is not None else {}), **balanced}, sources=source_figures(tr, t[7:]),
        ranks=ranks))


def encoder_figures(tr) -> dict:
    """``--encoder-balance``'s figures of the step (the plan every vision rank computed alike; no collective)."""
    if not tr.cfg.reorder.encoder_balance:
        return {}
    from mimo_sft.train.encoder_balance import take_step_figures

    return take_step_figures()


def source_figures(tr, t: torch.Tensor) -> dict:
    """``loss/<name>``, ``tokens/<name>``, ``samples/<name>`` from the reduced per-source sums, and
    ``epochs/<name>``: how many times the source has been read so far (from the interleave, no collective)."""
    mixture = tr.feed.mixture
    if mixture is None:
        return {}
    if tr.mixture_order is None:
        tr.mixture_order = mixture.order(seed=tr.cfg.train.seed, shuffle=False)
    names, n, out = mixture.names, len(mixture.names), {}
    for i, (name, epochs) in enumerate(zip(names, mixture.epochs(tr.mixture_order, tr.consumed))):
        loss_sum, tokens, samples = float(t[i]), float(t[n + i]), int(t[2 * n + i])
        if tokens > 0:
            out[f"loss/{name}"] = loss_sum / tokens
        out[f"tokens/{name}"], out[f"samples/{name}"], out[f"epochs/{name}"] = tokens, samples, round(epochs, 6)
    return out
