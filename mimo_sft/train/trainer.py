"""The training loop as one object: ``Trainer`` holds a run's parts as typed attributes and drives them.

::

    Trainer(cfg, layout).run()   # setup -> train (train_step, log_step, maybe_save per step)
                                 # -> close -> shutdown -> export (rank 0, --export-hf)

``setup`` builds the parts in the order they depend on each other:

==============  ============================================================  ===========================
attribute       what                                                          built by
==============  ============================================================  ===========================
``rank``        this process's rank in the world group                        ``parallel.bootstrap``
``pstate``      the layout's grids and process groups                         ``train.setup.build_state``
``ctx``         model (DDP-wrapped modules), optimizer, model info            ``train.setup``
``step``,       where the run starts: 0, or the checkpoint's step and data    :meth:`resume`
``consumed``    position                                                      (``train.checkpoint``)
``feed``        this rank's micro-batches, with the step's observers          ``train.feed.build_feed``
``runner``      megatron's schedule for this layout                           ``train.step.StepRunner``
``logger``      metrics.jsonl, TensorBoard and the progress line              ``train.metrics``
``startup``     seconds from the process's start to step 1, by part           ``train.startup``
``evaluator``   validation loss (None without a validation set)               ``train.evaluate``
==============  ============================================================  ===========================

Every rank runs every method; what only some ranks do (logging, the loss reduction, export) is
decided inside, so collectives stay matched across ranks.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from mimo_sft.config.families import family_for_model_type
from mimo_sft.config.loader import config_to_dict, dump_config, save_folder
from mimo_sft.config.recorded import lr_decay_length
from mimo_sft.config.schema import ExperimentConfig
from mimo_sft.data.mixture import MixtureOrder, check_resumed_mixture, resumed_interleave
from mimo_sft.data.streamed import check_resumed_streams
from mimo_sft.data.validation import check_resumed_split, split_sources, valid_flag
from mimo_sft.errors import UserError
from mimo_sft.model.gdn_binding import current_choice as gdn_choice
from mimo_sft.parallel import runtime
from mimo_sft.parallel.bootstrap import start_world
from mimo_sft.parallel.groups import ParallelState
from mimo_sft.parallel.layout import LANGUAGE, Layout
from mimo_sft.progress import PROGRESS
from mimo_sft.train.bad_samples import BadSampleTally
from mimo_sft.train.checkpoint.save import restore, save_checkpoint, save_gradients
from mimo_sft.train.checkpoint.files import BEST, latest_name, mark_best, read_meta, resolve_checkpoint
from mimo_sft.train.checkpoint.write import PendingSaves
from mimo_sft.train.evaluate import EvalResult, Evaluator
from mimo_sft.train.feed import Feed, build_feed, checked_source
from mimo_sft.train.flops import peak_tflops_for
from mimo_sft.train.lr import apply_schedule, lr_at
from mimo_sft.train.expert_load import ExpertLoad, expert_load_for
from mimo_sft.train.metrics import AnswerTally, MetricsLogger
from mimo_sft.train.profile import ModulePhases, StepProfiler, phase
from mimo_sft.train.step_log import PendingRows, log_step
from mimo_sft.train.straggler import StragglerReport, host_names, install_test_hook
from mimo_sft.train.watchdog import start_watchdog
from mimo_sft.train.setup import TrainContext, build_model_and_optimizer, build_state
from mimo_sft.train.startup import StartupClock, slowest
from mimo_sft.train.step import StepOutput, StepRunner
from mimo_sft.train.stopping import REASONS, StopPolicy, agree, resume_command
from mimo_sft.train.trackers import open_trackers


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Trainer.train_step` hands to :meth:`Trainer.log_step`."""

    lr: float
    output: StepOutput
    grad_norm: Optional[float]
    update_ok: bool
    step_time_s: float  # the host's seconds (time limits, the hang watchdog, the straggler report)
    phase_s: dict = field(default_factory=dict)  # this rank's seconds per phase (mimo_sft.progress)
    clock: Optional[runtime.StepClock] = None  # the step's time for its metrics row (CUDA events on a GPU)


class Trainer:
    """One rank's share of a fine-tuning run; see the module docstring."""

    cfg: ExperimentConfig
    layout: Layout
    output_dir: str
    save_dir: str
    rank: int
    pstate: ParallelState
    ctx: TrainContext
    step: int
    consumed: int
    feed: Feed
    bad_samples: BadSampleTally  # --max-bad-samples over every rank (distinct samples)
    runner: StepRunner
    logger: MetricsLogger
    answers: AnswerTally
    evaluator: Optional[Evaluator]
    best_loss: Optional[float]  # --save-best: the lowest valid_loss of a saved checkpoint so far
    peak_tflops: Optional[float]
    stop: StopPolicy
    profiler: StepProfiler  # --profile-steps (inactive without it)
    phases: ModulePhases  # each module's forward and backward entered as phases (watchdog, straggler report)
    straggler: StragglerReport  # per-rank phase times every --log-interval steps
    expert_load: Optional[ExpertLoad]  # a mixture-of-experts model's routing figures (None: dense)
    mixture_order: Optional[MixtureOrder] = None  # a mixture's interleave, for its sources' epochs (built once)
    startup: StartupClock  # this rank's start-up seconds by part (train.startup)
    startup_figures: dict  # the slowest rank's ``startup_*`` figures and ``startup_rank`` (the banner's, metrics')

    def __init__(self, cfg: ExperimentConfig, layout: Layout):
        self.cfg = cfg
        self.layout = layout
        self.output_dir = cfg.logging.output_dir
        self.save_dir = save_folder(cfg)
        self.step = 0
        self.consumed = 0
        self._stop_reason = 0

    # ---- the whole run --------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.setup()
            self.train()
        finally:
            self.close()
        self.shutdown()
        if self.cfg.checkpoint.export_hf and self.rank == 0 and not self._stop_reason:
            try:
                self.export()
            except Exception as err:  # noqa: BLE001 - the run's weights are safe: say where, and how to retry
                raise UserError(self._export_failed(err)) from None
        return 0

    def _export_failed(self, err: Exception) -> str:
        """One line for an export that failed after training: what was kept, where, and the retry."""
        from mimo_sft.train.checkpoint.files import latest_name

        kept = latest_name(self.save_dir)
        where = os.path.join(self.save_dir, kept) if kept else self.save_dir
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (f"training finished and its final checkpoint is kept in {where}, but --export-hf "
                f"{self.cfg.checkpoint.export_hf} failed ({type(err).__name__}: {reason}); export it with "
                f"`mimo-sft export --checkpoint {self.save_dir} --out DIR`")

    @property
    def global_batch_size(self) -> int:
        return self.cfg.train.global_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.cfg.train.global_batch_size // self.cfg.train.micro_batch_size

    @property
    def is_last_language_stage(self) -> bool:
        """A language rank on the last pipeline stage: it holds losses and reduces them over its DP group."""
        c = self.layout.coords(self.rank).get(LANGUAGE)
        return c is not None and c.pp == self.layout.language.pp - 1

    # ---- building ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Start the world, build groups, model and optimizer, resume, then the feed, runner and logger, and take
        the first micro-batch; each part timed (``train.startup``: the banner's start-up line, ``startup_*``)."""
        cfg, layout = self.cfg, self.layout
        t = cfg.train
        clock = self.startup = StartupClock()
        self.stop = StopPolicy(signal_handler=t.exit_signal_handler, exit_interval=t.exit_interval,
                               exit_duration_mins=t.exit_duration_in_mins)
        with clock.part("groups"):
            self.rank, _ = start_world(timeout_s=cfg.train.dist_timeout_s)
            self.watchdog = start_watchdog(cfg, self.output_dir, self.rank)
            if self.rank == 0:
                os.makedirs(self.output_dir, exist_ok=True)
                with open(os.path.join(self.output_dir, "config.yaml"), "w") as fh:
                    fh.write(dump_config(cfg))
            self.pstate = build_state(cfg, layout)
        with clock.part("model"):
            self.ctx = build_model_and_optimizer(cfg, layout, self.pstate, self.rank, startup=clock)
        self.expert_load = expert_load_for(cfg, self.ctx, layout)  # None for a dense model
        self.pending_saves = PendingSaves() if cfg.checkpoint.async_save else None
        with clock.part("resume"):
            self.resume()
        with clock.part("data"):
            valid_source = self._open_data()
        self.bad_samples = BadSampleTally(self.feed.source, limit=cfg.data.max_bad_samples,
                                          group=self.pstate.world_gloo, announce=self.ctx.is_metrics_rank)
        self.runner = StepRunner(model=self.ctx.model, modules=self.ctx.modules, pstate=self.pstate, layout=layout,
                                 feed=self.feed, modality_inputs_fn=self.ctx.info.modality_inputs,
                                 seq_length=cfg.data.seq_length, local_mbs=cfg.train.micro_batch_size // layout.language.dp,
                                 packing=cfg.data.in_batch_packing)
        if self.expert_load is not None and self.expert_load.aux_coeff > 0:
            self.runner.micro_batch_hook = self.expert_load.see
            if layout.language.cp > 1:  # the sequence's loss from the cp group's sums (train.expert_load)
                self.runner.split_hook = self.expert_load.see_cp
        self.runner.n_sources = len(self.feed.mixture.names) if self.feed.mixture is not None else 0
        self.logger = MetricsLogger(self.output_dir, enabled=self.ctx.is_metrics_rank, total_steps=cfg.train.train_iters,
                                    log_interval=cfg.logging.log_interval, tensorboard=cfg.logging.tensorboard,
                                    trackers=open_trackers(cfg.logging, config_to_dict(cfg)) if self.ctx.is_metrics_rank else [],
                                    resume_step=self.step if (cfg.checkpoint.load_checkpoint or cfg.checkpoint.resume_auto)
                                    else None)
        self.answers = AnswerTally(cfg.data.seq_length, enabled=self.ctx.is_metrics_rank)
        self.pending_rows = PendingRows()  # step records waiting for their device losses (train.step_log)
        self.evaluator = (None if valid_source is None else  # checks the set before step 0
                          Evaluator(cfg, layout, self.pstate, self.ctx, self.runner, valid_source, flag=valid_flag(cfg.data)))
        best = latest_name(self.save_dir, BEST) if cfg.checkpoint.save_best else None
        self.best_loss = read_meta(os.path.join(self.save_dir, best)).get("valid_loss") if best else None
        self.phases = ModulePhases(self._profiled_modules())
        self.profiler = StepProfiler.from_config(cfg, rank=self.rank, world_size=layout.world_size, modules={})
        self.straggler = StragglerReport(rank=self.rank, world_size=layout.world_size, layout=layout,
                                         log_interval=cfg.logging.log_interval, total_steps=t.train_iters,
                                         threshold=cfg.logging.straggler_threshold,
                                         hosts=host_names(self.pstate.world_gloo))
        install_test_hook(self.rank)
        self.profiler.say_if_passed(self.step)  # after resume(): a range the checkpoint is already past
        self.peak_tflops = cfg.logging.peak_tflops or (peak_tflops_for(runtime.device_name()) if runtime.on_gpu() else None)
        with clock.part("first_batch"):
            self.feed.prefetch()
        self._startup_figures()
        self._announce()

    def _open_data(self):
        """The training feed (``self.feed``) from the checked sources; the validation source (None: no set)."""
        cfg, t = self.cfg, self.cfg.train
        train_source, valid_source = split_sources(cfg.data, seed=t.seed, global_batch_size=t.global_batch_size,
                                                   load_full=lambda: checked_source(cfg, self.pstate),
                                                   load_valid=lambda data_cfg: checked_source(cfg, self.pstate, data_cfg))
        meta = read_meta(resolve_checkpoint(cfg.checkpoint.load_checkpoint)) if cfg.checkpoint.load_checkpoint else {}
        self.feed = build_feed(cfg, self.layout, self.pstate, self.ctx.info, consumed_samples=self.consumed,
                               train_source=train_source, interleave=resumed_interleave(meta.get("mixture")))
        if cfg.checkpoint.load_checkpoint:  # a mixture resumes only on the same sources, rows and shares
            ckpt = resolve_checkpoint(cfg.checkpoint.load_checkpoint)
            check_resumed_mixture(meta.get("mixture"), self.feed.mixture, checkpoint=ckpt)
            check_resumed_streams(meta.get("streams"), self.feed.stream_position(self.consumed), checkpoint=ckpt)
        return valid_source

    def _startup_figures(self) -> None:
        """End the start-up clock; the slowest rank's figures (every rank's, gathered: step 1 waits for the last
        one ready) go to the banner and the first metrics row, with that rank's number (``startup_rank``)."""
        self.startup.stop()
        mine = self.startup.metrics()
        figures = [mine]
        if self.layout.world_size > 1:
            figures = [None] * self.layout.world_size
            dist.all_gather_object(figures, mine, group=self.pstate.world_gloo)
        rank, worst = slowest(figures)
        self.startup_figures = {**worst, "startup_rank": rank}
        self.logger.first_row = dict(self.startup_figures)

    def _profiled_modules(self) -> dict:
        """The modules whose forward and backward are phases, and ranges in a ``--profile-steps`` trace (the
        modules megatron's DDP wraps, on this rank)."""
        return {("language" if name == LANGUAGE else "encoder"): module.module
                for name, module in self.ctx.modules.items()}

    def resume(self) -> None:
        """Load what the run starts from (``--load-checkpoint``: everything; ``--pretrained-checkpoint``:
        weights) and take its step and data position; refuse a run with no step left to train."""
        self.step, self.consumed = restore(self.cfg, self.ctx)
        if self.cfg.checkpoint.load_checkpoint:
            ckpt = resolve_checkpoint(self.cfg.checkpoint.load_checkpoint)
            check_resumed_split(read_meta(ckpt).get("valid_split"), self.cfg.data, checkpoint=ckpt)
        if self.step >= self.cfg.train.train_iters:
            raise UserError(f"nothing to do: the checkpoint is at step {self.step} and --train-iters is "
                            f"{self.cfg.train.train_iters}; raise --train-iters to train further")

    def _announce(self) -> None:
        if not self.ctx.is_metrics_rank:
            return
        cfg, layout = self.cfg, self.layout
        t = cfg.train
        layout_text = " ".join(s.to_flag() for s in layout.components)
        start = (f"resuming at step {self.step} ({self.consumed} samples consumed)" if self.step
                 else "starting at step 0")
        ranks = f"{layout.world_size} rank{'s' if layout.world_size != 1 else ''}"
        print(f"mimo-sft: {ranks}, {'colocated' if layout.colocated else 'non-colocated'}: "
              f"{layout_text}\n"
              f"mimo-sft: {t.train_iters} steps of {t.global_batch_size} samples ({self.num_microbatches} "
              f"micro-batches of {t.micro_batch_size}), reordering {f'on ({cfg.reorder.mode})' if cfg.reorder.enabled else 'off'}, "
              f"{start}, output {self.output_dir}\n"
              f"mimo-sft: {self._checkpoint_plan()}", flush=True)
        where = (f" (rank {self.startup_figures['startup_rank']}, the slowest of {layout.world_size})"
                 if layout.world_size > 1 else "")
        print(f"mimo-sft: {StartupClock.line_of(self.startup_figures)}{where}", flush=True)
        if cfg.reorder.enabled and cfg.reorder.calibration:
            print(f"mimo-sft: reordering cost weights {cfg.reorder.calibration}", flush=True)
        if family_for_model_type(self.ctx.info.model_type).architecture.hybrid_gdn:
            print(f"mimo-sft: {gdn_choice().line()}", flush=True)
        if cfg.checkpoint.resume_auto:
            print(f"mimo-sft: --load-checkpoint auto: " + (f"resuming from {cfg.checkpoint.load_checkpoint}" if
                  cfg.checkpoint.load_checkpoint else f"no checkpoint in {self.save_dir} yet: starting fresh"),
                  flush=True)
        if cfg.checkpoint.recorded:  # what the checkpoint gave where no flag did (config.recorded)
            print(f"mimo-sft: {cfg.checkpoint.recorded}", flush=True)
        if self.feed.mixture is not None:
            print(f"mimo-sft: data mixture: {self.feed.mixture.rows_text(t.train_iters * t.global_batch_size)}",
                  flush=True)
        for path in getattr(self.feed.source, "cost_files", ()):  # check-data --write-costs: no row read to plan
            print(f"mimo-sft: reordering costs from {path}", flush=True)
        for why in getattr(self.feed.source, "cost_notes", ()):
            print(f"mimo-sft: {why}", flush=True)
        pre = self._preprocessor()
        if pre is not None:  # fitted: --max-pixels unset and the checkpoint's limit lets one image pass --seq-length
            print(f"mimo-sft: images resized as transformers' {pre.image_backend} image processor does (--image-backend "
                  f"{self.cfg.data.image_backend})" + (f"; {fitted}" if (fitted := pre.fitted_note()) else ""), flush=True)

    def _preprocessor(self):
        """This rank's sample preprocessor (its pixel limits), where its feed reads samples."""
        return getattr(getattr(self.feed.source, "dataset", None), "pre", None)

    def _checkpoint_plan(self) -> str:
        """Where the weights go and how often, said before step 0 (a run must never end without
        weights by surprise)."""
        ck = self.cfg.checkpoint
        if ck.no_save:
            return "--no-save: no checkpoint will be written; the weights are lost when the run ends"
        every = f"every {ck.save_interval} steps and " if ck.save_interval else ""
        text = f"checkpoints: {self.save_dir}, {every}at the end (step {self.cfg.train.train_iters})"
        if ck.export_hf:
            text += f"; Hugging Face export to {ck.export_hf} after the last step"
        return text

    # ---- one step -------------------------------------------------------------------------------------
    def train(self) -> None:
        if self.evaluator is not None and self.cfg.train.eval_at_start:
            self.logger.log_validation(self.evaluator.evaluate(self.step))
        while self.step < self.cfg.train.train_iters:
            PROGRESS.begin_step(self.step + 1)
            self.profiler.begin_step(self.step + 1)
            result = self.train_step()
            self.profiler.end_step(self.step)
            self.watchdog.step_done(result.step_time_s)
            self.log_step(result)
            saved = self.maybe_save(self.maybe_evaluate())
            if self.step < self.cfg.train.train_iters and self.stopping(result.step_time_s):
                if not saved:
                    self.save()
                self.finish_saves()
                self.pending_rows.flush(self)
                self._say_stopped()
                return
        self.finish_saves()

    def stopping(self, last_step_s: float) -> bool:
        """Whether every rank stops now (``--exit-*`` flags). Collective when any rule is set."""
        if not self.stop.active:
            return False
        self._stop_reason = agree(self.stop.local_reason(self.step, last_step_s), self.pstate.world_gloo)
        return self._stop_reason > 0

    def _say_stopped(self) -> None:
        if self.rank == 0:
            print(f"mimo-sft: stopped after step {self.step} of {self.cfg.train.train_iters} "
                  f"({REASONS[self._stop_reason]}); checkpoint in {self.save_dir}; resume with:\n"
                  f"  {resume_command(self.save_dir, self.layout.world_size)}", flush=True)

    def train_step(self) -> StepResult:
        """Learning rate, zeroed gradients, megatron's schedule over the global batch, optimizer step."""
        clock = runtime.StepClock()
        o = self.cfg.optimizer
        total = lr_decay_length(self.cfg)  # --lr-decay-iters, a resumed run's recorded one, else --train-iters
        lr = lr_at(self.step, lr=o.lr, min_lr=o.min_lr, warmup=o.lr_warmup_iters, total=total, style=o.lr_decay_style)
        apply_schedule(self.ctx.optimizer, self.step, warmup=o.lr_warmup_iters, total=total,
                       style=o.lr_decay_style, weight_decay=o.weight_decay)
        runtime.reset_peak_memory()
        self.ctx.optimizer.zero_grad()
        out = self.runner.run(self.num_microbatches)
        if out.global_tokens <= 0:
            raise UserError(f"step {self.step + 1} has no supervised tokens (no assistant text after the chat "
                            f"template and truncation) in its {self.global_batch_size} samples: check the "
                            f"dataset's roles (user/assistant) and --seq-length")
        if self.cfg.logging.save_grads:
            save_gradients(os.path.join(self.cfg.logging.save_grads, f"iter_{self.step + 1:07d}"), self.ctx)
        with phase("optimizer"):
            ok, grad_norm, _ = self.ctx.optimizer.step()
        self.step += 1
        self.consumed += self.global_batch_size
        return StepResult(lr=lr, output=out, grad_norm=float(grad_norm) if grad_norm is not None else None,
                          update_ok=bool(ok), step_time_s=clock.stop(), phase_s=PROGRESS.take_seconds(), clock=clock)

    def log_step(self, result: StepResult) -> None:
        """The step's collectives, then (metrics rank) one ``StepMetrics`` record (``train.step_log``)."""
        log_step(self, result)

    def maybe_evaluate(self) -> Optional[EvalResult]:
        """Evaluate every ``--eval-interval`` steps and after the last step (collective)."""
        if self.evaluator is None:
            return None
        interval = self.cfg.train.eval_interval
        if (interval and self.step % interval == 0) or self.step == self.cfg.train.train_iters:
            self.pending_rows.flush(self)  # the steps' rows before the evaluation's
            with phase("evaluation"):
                evaluation = self.evaluator.evaluate(self.step)
            self.logger.log_validation(evaluation)
            return evaluation
        return None

    def maybe_save(self, evaluation: Optional[EvalResult] = None) -> bool:
        """Save every ``--save-interval`` steps, always at the last step (a finished run keeps its
        weights unless ``--no-save`` said not to), and with ``--save-best`` when ``evaluation`` is a
        new lowest validation loss. Collective; True when it saved."""
        ck = self.cfg.checkpoint
        if ck.no_save:
            return False
        if self.pending_saves is not None:
            self.pending_saves.poll()  # publish a background save whose bytes are all written
        interval = ck.save_interval
        final = self.step == self.cfg.train.train_iters
        best = (ck.save_best and evaluation is not None
                and (self.best_loss is None or evaluation.valid_loss < self.best_loss))
        if (interval and self.step % interval == 0) or final or best:
            with phase("checkpoint save"):
                self.save(evaluation, best=best)
            return True
        return False

    def save(self, evaluation: Optional[EvalResult] = None, *, best: bool = False) -> None:
        """Save this step (``--async-save``: in the background, said when published). A new best is
        written before training goes on, so that ``checkpoints/best`` can name it at once."""
        pre = self._preprocessor()
        extra = {"valid_split": self.cfg.data.valid_split,
                 **({"max_pixels": pre.max_pixels, "max_pixels_fitted": pre.fitted_max_pixels is not None,
                     "image_backend": pre.image_backend, "video": pre.video_settings} if pre is not None else {}),
                 **({"mixture": self.feed.mixture.fingerprint()} if self.feed.mixture is not None else {}),
                 **({"streams": streams} if (streams := self.feed.stream_position(self.consumed)) else {}),
                 **({"valid_loss": evaluation.valid_loss} if evaluation is not None else {})}
        pending = self.pending_saves
        if best and pending is not None:
            pending.wait()
            pending = None
        path = save_checkpoint(self.save_dir, step=self.step, consumed_samples=self.consumed, ctx=self.ctx,
                               extra_meta=extra, pending=pending,
                               on_published=self._say_saved if pending is not None else None)
        if path is None:  # in the background: said when published
            return
        if best:  # every rank knows the same valid_loss; rank 0 published the folder
            self.best_loss = evaluation.valid_loss
            if self.rank == 0:
                mark_best(self.save_dir, path, keep_last=self.cfg.checkpoint.keep_last_checkpoints)
        self._say_saved(path, best_loss=evaluation.valid_loss if best else None)

    def _say_saved(self, path: str, best_loss: Optional[float] = None) -> None:
        if self.ctx.is_metrics_rank:
            print(f"saved checkpoint {path}" + (f" (best: valid loss {best_loss:.4f})" if best_loss is not None else ""),
                  flush=True)

    def finish_saves(self) -> None:
        """A background save still being written completes (and is published) before the run ends."""
        if getattr(self, "pending_saves", None) is not None:
            self.pending_saves.wait()

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the feed's reorder thread and close the metrics files (also after an error); a
        profile of steps the run did not reach is written with what it has."""
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
        if getattr(self, "profiler", None) is not None:
            self.profiler.finish()
        if getattr(self, "phases", None) is not None:
            self.phases.remove()
        if getattr(self, "feed", None) is not None:
            self.feed.close()
        if getattr(self, "logger", None) is not None:
            self.logger.close()
        summary = self.answers.summary() if getattr(self, "answers", None) is not None else None
        if summary and self.answers.enabled:
            print(summary, flush=True)
        if getattr(self, "evaluator", None) is not None:
            self.evaluator.close()

    def shutdown(self) -> None:
        """Publish a background save still in flight, wait for every rank, then end the process group
        (the run's last collectives)."""
        self.finish_saves()
        dist.barrier()
        dist.destroy_process_group()

    def export(self) -> None:
        """``--export-hf``: rank 0 exports the final checkpoint after the other ranks have finished.

        Runs after :meth:`shutdown`: the training model, optimizer and process groups are released
        first, and export builds its 1-rank model in host memory (its own in-process group, see
        ``parallel.bootstrap``), so the export never holds more than one copy of the model and never
        waits on (or keeps waiting) any other rank.
        """
        from mimo_sft.train.export import export_checkpoint

        self.ctx.model = self.ctx.optimizer = self.ctx.modules = None
        self.runner.model = self.runner.modules = None
        gc.collect()
        runtime.release_cached_memory()
        out = export_checkpoint(self.save_dir, self.cfg.checkpoint.export_hf, hf_model=self.cfg.model.hf_model,
                                shard_size=self.cfg.checkpoint.export_shard_size)
        print(f"exported Hugging Face checkpoint to {out}", flush=True)
