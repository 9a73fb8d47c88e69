"""``mimo-sft finetune``: the training loop (thin; the pieces live beside it).

Every rank: load config -> run the validate checks (before any process group exists, so a bad
layout is refused on every rank with the same message) -> set up -> train -> save. A user error on
any rank is printed as one line and the rank exits with status 2; torchrun then stops the others,
so nothing hangs. Metrics come from the rank that owns the language loss.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from mimo_sft.config.checks import require_valid
from mimo_sft.config.loader import dump_config, load_config
from mimo_sft.errors import UserError


def _env_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _ensure_single_process_env(layout_world: int) -> None:
    """Allow ``mimo-sft finetune`` without torchrun for a 1-rank layout."""
    if "RANK" in os.environ:
        return
    if layout_world != 1:
        raise UserError(f"this layout needs {layout_world} ranks; start it with "
                        f"torchrun --nproc-per-node {layout_world} -m mimo_sft finetune ...")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def finetune(args: list[str]) -> int:
    rank, world = _env_world()
    try:
        cfg = load_config(args)
        if "WORLD_SIZE" in os.environ and cfg.parallel.world_size not in (None, world):
            raise UserError(f"--world-size {cfg.parallel.world_size} but torchrun started {world} processes; "
                            f"drop --world-size or start {cfg.parallel.world_size} processes")
        result = require_valid(cfg, world_size=world if "WORLD_SIZE" in os.environ else None, for_run=True)
        _ensure_single_process_env(result.layout.world_size)
        _refuse_reused_output_dir(cfg, cfg.logging.output_dir)
    except UserError as e:
        if rank == 0:
            for p in e.problems:
                print(f"error: {p}", file=sys.stderr)
        return 2
    try:
        return _train(cfg, result.layout)
    except UserError as e:
        _abort(f"error: [rank {rank}] {e}", 2)
    except KeyboardInterrupt:
        _abort(f"[rank {rank}] interrupted", 130)
    except Exception as e:  # noqa: BLE001 - decide between "a peer died" and "our bug"
        text = str(e)
        if any(s in text for s in PEER_FAILURE_MARKERS):
            _abort(f"error: [rank {rank}] stopped because another rank failed (see its error above)", 1)
        traceback.print_exc()
        _abort(f"error: [rank {rank}] internal error: {type(e).__name__}: {text.splitlines()[0] if text else ''}", 1)


#: what gloo/NCCL report on the surviving ranks when a peer process has died
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                        "NCCL communicator was aborted", "ProcessGroupNCCL is aborted")


def _abort(message: str, code: int):
    """Print one line and leave at once: a failed rank must not linger in teardown (process-group
    destructors, loader workers), because torchrun stops the other ranks only when this one exits."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _train(cfg, layout) -> int:
    from mimo_sft.quiet import quiet_libraries

    quiet_libraries()
    import torch
    import torch.distributed as dist

    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.groups import init_distributed
    from mimo_sft.train.checkpoint import restore, save_checkpoint
    from mimo_sft.train.data_source import build_feed
    from mimo_sft.train.lr import lr_at, set_lr
    from mimo_sft.train.flops import peak_tflops_for
    from mimo_sft.train.metrics import MetricsLogger, peak_memory_by_module, step_model_flops, throughput
    from mimo_sft.train.setup import build_model_and_optimizer, build_state
    from mimo_sft.train.step import StepRunner

    out_dir = cfg.logging.output_dir
    rank, world = init_distributed(timeout_s=cfg.train.dist_timeout_s)
    save_dir = cfg.checkpoint.save or os.path.join(out_dir, "checkpoints")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as fh:
            fh.write(dump_config(cfg))
    pstate = build_state(cfg, layout)
    ctx = build_model_and_optimizer(cfg, layout, pstate, rank)
    step, consumed = restore(cfg, ctx)
    if step >= cfg.train.train_iters:
        raise UserError(f"nothing to do: the checkpoint is at step {step} and --train-iters is "
                        f"{cfg.train.train_iters}; raise --train-iters to train further")
    mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
    num_mb = gbs // mbs
    feed = build_feed(cfg, layout, pstate, ctx.info, consumed_samples=consumed)
    local_lang_mbs = mbs // layout.language.dp
    runner = StepRunner(model=ctx.model, modules=ctx.modules, pstate=pstate, layout=layout, feed=feed,
                        modality_inputs_fn=ctx.info.modality_inputs, seq_length=cfg.data.seq_length,
                        local_mbs=local_lang_mbs)
    logger = MetricsLogger(out_dir, enabled=ctx.is_metrics_rank, total_steps=cfg.train.train_iters,
                           log_interval=cfg.logging.log_interval, tensorboard=cfg.logging.tensorboard)
    if ctx.is_metrics_rank:
        layout_text = " ".join(s.to_flag() for s in layout.components)
        start = f"resuming at step {step} ({consumed} samples consumed)" if step else "starting at step 0"
        print(f"mimo-sft: {layout.world_size} ranks, {'colocated' if layout.colocated else 'non-colocated'}: {layout_text}\n"
              f"mimo-sft: {cfg.train.train_iters} steps of {gbs} samples ({num_mb} micro-batches of {mbs}), "
              f"reordering {'on' if cfg.reorder.enabled else 'off'}, {start}, output {out_dir}", flush=True)
    lang = pstate.modules.get("language")
    lang_last = lang is not None and lang.member and layout.coords(rank)["language"].pp == layout.language.pp - 1
    o = cfg.optimizer
    peak_tflops = cfg.logging.peak_tflops or (peak_tflops_for(runtime.device_name()) if runtime.on_gpu() else None)
    try:
        while step < cfg.train.train_iters:
            t0 = time.perf_counter()
            lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup=o.lr_warmup_iters, total=cfg.train.train_iters,
                       style=o.lr_decay_style)
            set_lr(ctx.optimizer, lr)
            runtime.reset_peak_memory()
            ctx.optimizer.zero_grad()
            out = runner.run(num_mb)
            if out.global_tokens <= 0:
                raise UserError(f"step {step + 1} has no supervised tokens (no assistant text after the chat template "
                                f"and truncation) in its {gbs} samples: check the dataset's roles "
                                f"(user/assistant) and --seq-length")
            ok, grad_norm, _ = ctx.optimizer.step()
            step += 1
            consumed += gbs
            step_time = time.perf_counter() - t0
            c = feed.counters
            peaks = peak_memory_by_module(pstate)  # collective: every rank's peak of this step
            model_flops = step_model_flops(c.model_flops, pstate)  # collective
            if lang_last:
                t = torch.tensor([out.loss_sum, out.num_tokens, c.real_tokens, float(c.samples)], dtype=torch.float64)
                if lang.dp_gloo is not None and dist.get_world_size(lang.dp_gloo) > 1:
                    dist.all_reduce(t, group=lang.dp_gloo)
                loss = float(t[0] / max(t[1], 1.0))
                if not torch.isfinite(torch.tensor(loss)):
                    raise UserError(f"loss became {loss} at step {step}; lower --lr or check the data")
                logger.log({
                    "step": step, "loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "lr": lr, "step_time_s": step_time, "tokens_per_s": float(t[2]) / step_time,
                    "samples_per_s": float(t[3]) / step_time, "supervised_tokens": float(t[1]),
                    "vision_load_max_over_mean_before": _mean(c.load_before),
                    "vision_load_max_over_mean_after": _mean(c.load_after),
                    "reorder_exchange_s": c.exchange_s, "data_wait_s": c.data_wait_s,
                    **peaks, "model_flops": model_flops,
                    **throughput(model_flops, step_time, layout.world_size, peak_tflops),
                    "update_ok": bool(ok),
                    "consumed_samples": consumed,
                })
            interval = cfg.checkpoint.save_interval
            final = step == cfg.train.train_iters and (interval or cfg.checkpoint.save or cfg.checkpoint.export_hf)
            if (interval and step % interval == 0) or final:
                path = save_checkpoint(save_dir, step=step, consumed_samples=consumed, ctx=ctx)
                if ctx.is_metrics_rank:
                    print(f"saved checkpoint {path}", flush=True)
    finally:
        feed.close()
        logger.close()
    dist.barrier()
    dist.destroy_process_group()
    if cfg.checkpoint.export_hf and rank == 0:
        _export_in_process(ctx, runner, save_dir, cfg)
    return 0


def _export_in_process(ctx, runner, save_dir: str, cfg) -> None:
    """``--export-hf``: rank 0 exports the final checkpoint after the other ranks have finished.

    The training model, optimizer and process groups are released first, and export builds its
    1-rank model in host memory, so the export never holds more than one copy of the model and
    never waits on (or keeps waiting) any other rank.
    """
    import gc

    from mimo_sft.parallel import runtime
    from mimo_sft.train.export import export_checkpoint

    ctx.model = ctx.optimizer = ctx.modules = runner.model = runner.modules = None
    gc.collect()
    runtime.release_cached_memory()
    out = export_checkpoint(save_dir, cfg.checkpoint.export_hf, hf_model=cfg.model.hf_model)
    print(f"exported Hugging Face checkpoint to {out}", flush=True)


def _refuse_reused_output_dir(cfg, out_dir: str) -> None:
    """A fresh run must not append to another run's metrics or move its ``latest`` checkpoint back."""
    if cfg.checkpoint.load_checkpoint:
        return
    save_dir = cfg.checkpoint.save or os.path.join(out_dir, "checkpoints")
    traces = [p for p in (os.path.join(out_dir, "metrics.jsonl"), os.path.join(save_dir, "latest")) if os.path.exists(p)]
    if traces:
        resume = (f"resume it with --load-checkpoint {save_dir}, or " if os.path.exists(os.path.join(save_dir, "latest"))
                  else "")
        raise UserError(f"--output-dir {out_dir} already holds a run ({traces[0]}); {resume}choose a new --output-dir "
                        f"(or delete the old one)")


def _mean(values):
    return sum(values) / len(values) if values else None
