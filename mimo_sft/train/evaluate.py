"""Validation loss: forward-only passes over the validation set on the training layout.

``Evaluator.evaluate`` runs megatron's schedule for this layout (non-colocated 1F1B, colocated
no-pipelining; ``StepRunner.forward_only``) over every evaluated validation micro-batch, in dataset
order, each rank reading its canonical-grid shard as in training (no reordering: it would move
samples between ranks, never change the sum). The value is the training loss's definition:

    valid_loss = sum of per-token losses over the assistant tokens of all evaluated samples
                 / number of those tokens

summed on each language DP rank of the last pipeline stage (tensor rank 0: every TP rank holds the
same loss) and all-reduced over the world, so every rank gets the same value (``--save-best``
decides on every rank alike). ``valid_ppl = exp(valid_loss)``.

No side effects on training: no backward, no gradient buffers touched, dropout off
(``model.eval()``, each module's mode restored after), and every RNG stream (Python, numpy, torch,
device, megatron's tracker) restored, so a run that evaluates trains bit-identically to one that
does not. The validation reader has its own loader and generator, apart from the training feed.

``mimo-sft evaluate`` (:func:`evaluate_command`) builds the same parts without training: the
weights of ``--hf-model``, or of a checkpoint on top of them, evaluated once on any layout.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from mimo_sft.config.mixture import dataset_label
from mimo_sft.data.loader import build_preprocessor, resolve_num_workers
from mimo_sft.data.validation import ValidationReader, evaluated_samples, no_supervised_tokens, shard_tokens
from mimo_sft.errors import UserError
from mimo_sft.parallel import runtime
from mimo_sft.parallel.layout import IMAGES, LANGUAGE
from mimo_sft.train.feed import Feed, checked_source, read_shard


@dataclass(frozen=True)
class EvalResult:
    """One evaluation; ``step`` is the optimizer step it follows (0: before the first)."""

    step: int
    valid_loss: float
    valid_ppl: float
    valid_tokens: float
    valid_samples: int
    valid_time_s: float
    #: a validation mixture's per source: ``valid_loss/<name>`` and ``valid_tokens/<name>`` (empty for one set)
    valid_sources: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        row = asdict(self)
        return {**{k: v for k, v in row.items() if k != "valid_sources"}, **self.valid_sources}


class Evaluator:
    """This rank's part of every evaluation of one run (built once, before step 0)."""

    def __init__(self, cfg, layout, pstate, ctx, runner, source, *, flag: str):
        mbs = cfg.train.micro_batch_size
        pre = build_preprocessor(cfg.data, cfg.model.hf_model)
        self.n_samples = evaluated_samples(len(source), eval_iters=cfg.train.eval_iters,
                                           global_batch_size=cfg.train.global_batch_size)
        # refuses, before step 0, a set without supervised tokens or with a sample that cannot fit
        self.expected_tokens = checked_tokens(source, pre, self.n_samples, flag=flag,
                                              group=getattr(pstate, "startup_gloo", None))
        shard = read_shard(layout, pstate, ctx.info, mbs)
        self.reader = ValidationReader(source, pre, n_samples=self.n_samples, micro_batch_size=mbs,
                                       dp_size=shard.dp_size, dp_rank=shard.dp_rank, need_pixels=shard.need_pixels,
                                       scalable_dp=cfg.parallel.scalable_dp,
                                       num_workers=resolve_num_workers(cfg.data.num_workers),
                                       pad_to_seq_length=cfg.data.pad_to_seq_length, flag=flag,
                                       # colocated: decode only the encoder slice's images, as training does
                                       pixel_slice=(shard.split.encoder.start, shard.split.encoder.stop)
                                       if shard.split is not None else None)
        self.split = shard.split
        self.packed = cfg.data.in_batch_packing
        self.model = ctx.model
        self.runner = runner
        self.names = list(getattr(source, "names", None) or [])  # a validation mixture's sources
        self.world = pstate.world_gloo
        c = layout.coords(pstate.rank).get(LANGUAGE)
        #: the ranks whose losses are summed: last language stage, tensor rank 0, one per DP rank and (context
        #: parallelism: each holds its positions' sums) per cp rank
        self.counts_loss = c is not None and c.pp == layout.language.pp - 1 and c.tp == 0

    def evaluate(self, step: int) -> EvalResult:
        """Collective (every rank): the validation loss at the current weights."""
        t0 = time.perf_counter()
        feed = Feed(iter(self.reader), split=self.split, packed=self.packed)
        rng = runtime.rng_state()
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        n = len(self.names)
        training_sources, self.runner.n_sources = self.runner.n_sources, n
        try:
            loss_sum, tokens = self.runner.forward_only(feed, self.reader.micro_batches)
            sums = self.runner.source_sums
        finally:
            self.runner.n_sources = training_sources
            for module, training in modes:
                module.training = training
            runtime.set_rng_state(rng)
        per = [*sums[0], *sums[1]] if sums is not None and self.counts_loss else [0.0] * (2 * n)
        t = torch.tensor([loss_sum, tokens, *per] if self.counts_loss else [0.0, 0.0, *per], dtype=torch.float64)
        dist.all_reduce(t, group=self.world)
        total_loss, total_tokens = float(t[0]), float(t[1])
        assert total_tokens == self.expected_tokens, (total_tokens, self.expected_tokens)
        loss = total_loss / total_tokens
        by_source = {}
        for i, name in enumerate(self.names):
            loss_i, tokens_i = float(t[2 + i]), float(t[2 + n + i])
            if tokens_i > 0:
                by_source[f"valid_loss/{name}"] = loss_i / tokens_i
            by_source[f"valid_tokens/{name}"] = tokens_i
        return EvalResult(step=step, valid_loss=loss, valid_ppl=_ppl(loss), valid_tokens=total_tokens,
                          valid_samples=self.n_samples, valid_time_s=time.perf_counter() - t0,
                          valid_sources=by_source)

    def close(self) -> None:
        self.reader = None  # ends persistent loader workers


def checked_tokens(source, pre, n_samples: int, *, flag: str, group) -> int:
    """Supervised tokens of the ``n_samples`` evaluated samples, each tokenised on one rank only:
    rank r of ``group`` takes samples r, r + world, ... (``data.validation.shard_tokens``; the set is
    never tokenised whole on every rank). Every rank's ``(tokens, first refusal)`` is all-gathered on
    the start-up group (its long timeout: this is start-up work), so every rank raises the same line
    before step 0 -- the lowest refused sample's, else the no-supervised-tokens one -- or none."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    tokens, refused = shard_tokens(source, pre, range(rank, n_samples, world), flag=flag)
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, (tokens, refused), group=group)
        tokens = sum(t for t, _ in parts)
        refused = min((r for _, r in parts if r is not None), default=None)
    if refused is not None:
        raise UserError(refused[1])
    if tokens == 0:
        raise UserError(no_supervised_tokens(flag, n_samples, pre.seq_length))
    return tokens


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


# ---- mimo-sft evaluate ---------------------------------------------------------------------------

#: flags of ``mimo-sft evaluate`` beyond the config flag table
EVALUATE_FLAGS = {"CHECKPOINT": "(first argument, optional) a mimo-sft checkpoint folder, or its parent with "
                                "'latest'; without one, --hf-model's weights are evaluated",
                  "--checkpoint": "the same as the first argument (or --load-checkpoint)",
                  "--json": "print the result as one JSON object"}


def evaluate_command(args: list[str]) -> int:
    """``mimo-sft evaluate``: every rank loads the config, runs the checks, builds the layout, loads
    the weights and joins one evaluation; the metrics rank prints the result (:func:`evaluate_args`: what it
    takes without a flag)."""
    from mimo_sft.parallel.bootstrap import launch_rank_world
    from mimo_sft.train.elastic import launch, split_launch_flags
    from mimo_sft.train.launch import checked_config, launch_checked

    opts, args = split_launch_flags(args)
    worker_args = list(args)  # what each worker of mimo-sft's own launcher is given (it reads them as below)
    as_json = "--json" in args
    args, layout = evaluate_args(args, opts.world_size if opts is not None else launch_rank_world()[1])
    if opts is not None:  # mimo-sft's own launcher: check once, start the workers (train.elastic)
        return launch("evaluate", opts, worker_args,
                      check=lambda _args, world: checked_config(args, world, started_by=opts.started_by))
    return launch_checked(args, lambda cfg, layout_: _evaluate(cfg, layout_, as_json, default_layout=layout))


def evaluate_args(args: list[str], world: int) -> tuple[list[str], list[str]]:
    """``(the config flags, the components it added)``: ``mimo-sft evaluate``'s arguments (without the launcher's)
    as every rank checks them for a run of ``world`` processes. The checkpoint (first argument, ``--checkpoint``
    or ``--load-checkpoint``) is loaded as ``--pretrained-checkpoint`` loads weights, on any layout (no optimizer
    state is read), with its LoRA settings unless given (``config.recorded``); its base model (``hf_model`` in
    its meta.json) is the default ``--hf-model``; without ``--component`` (or the YAML's layout) every process
    holds both modules: ``language=dp=W images=dp=W`` (one process: dp 1)."""
    from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint

    args = [a for a in args if a != "--json"]
    if args and not args[0].startswith("-"):
        args = ["--pretrained-checkpoint", *args]
    args = ["--pretrained-checkpoint" if a in ("--checkpoint", "--load-checkpoint") else a for a in args]
    names_model, names_layout = _config_names(args)
    if "--pretrained-checkpoint" in args and "--hf-model" not in args and not names_model:
        i = args.index("--pretrained-checkpoint") + 1
        base = read_meta(resolve_checkpoint(args[i])).get("hf_model") if i < len(args) else None
        args += ["--hf-model", base] if base else []
    layout = []
    if "--component" not in args and not names_layout:
        layout = [f"{LANGUAGE}=dp={world}", f"{IMAGES}=dp={world}"]
        args += [a for c in layout for a in ("--component", c)]
    return args, layout


def _config_names(args: list[str]) -> tuple[bool, bool]:
    """Whether ``--config``'s YAML names the model itself and the layout (then the checkpoint's base model, and
    one process, are not the defaults)."""
    from mimo_sft.config.loader import load_config

    if "--config" not in args:
        return False, False
    try:
        cfg = load_config(args)
    except UserError:
        return False, False  # the run's own check says what is wrong
    return bool(cfg.model.hf_model), bool(cfg.parallel.components)


def _taken_line(cfg, default_layout: list[str]) -> str:
    """What ``mimo-sft evaluate`` took without a flag giving it: the checkpoint's settings, the layout."""
    said = [cfg.checkpoint.recorded] if cfg.checkpoint.recorded else []
    if default_layout:
        n = int(default_layout[0].rsplit("=", 1)[1])
        processes = "one process" if n == 1 else f"{n} processes"
        said.append(f"{processes} ({' '.join(default_layout)}; no --component given)")
    return "; ".join(said)


def _evaluate(cfg, layout, as_json: bool, *, default_layout: list[str]) -> int:
    from mimo_sft.data.validation import split_sources, valid_flag
    from mimo_sft.parallel.bootstrap import start_world
    from mimo_sft.train.checkpoint.model import encoder_replica_rank
    from mimo_sft.train.checkpoint.save import load_model_weights
    from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint
    from mimo_sft.train.checkpoint.lora import check_lora_compatible
    from mimo_sft.train.setup import build_model_and_optimizer, build_state
    from mimo_sft.train.step import StepRunner

    ckpt = cfg.checkpoint.load_checkpoint or cfg.model.pretrained_checkpoint
    rank, _ = start_world(timeout_s=cfg.train.dist_timeout_s)
    pstate = build_state(cfg, layout)
    ctx = build_model_and_optimizer(cfg, layout, pstate, rank, with_optimizer=False)
    if ckpt:  # the weights only (as --pretrained-checkpoint loads them); no optimizer is built
        folder = resolve_checkpoint(ckpt)
        check_lora_compatible(read_meta(folder), cfg.model, path=folder, resume=False)
        load_model_weights(ctx.model, folder, pretrained=True, replicated_encoder_rank=encoder_replica_rank(ctx))
    # opened once per node and checked on one rank, as training does (no verdict cache: no run folder)
    _train, source = split_sources(cfg.data, seed=cfg.train.seed, global_batch_size=cfg.train.global_batch_size,
                                   load_full=lambda: checked_source(cfg, pstate, cache_verdict=False),
                                   load_valid=lambda data_cfg: checked_source(cfg, pstate, data_cfg,
                                                                              cache_verdict=False))
    flag = valid_flag(cfg.data) if source is not None else "--dataset-path"
    if source is None:
        source = checked_source(cfg, pstate, cache_verdict=False)
    runner = StepRunner(model=ctx.model, modules=ctx.modules, pstate=pstate, layout=layout, feed=None,
                        modality_inputs_fn=ctx.info.modality_inputs, seq_length=cfg.data.seq_length,
                        local_mbs=cfg.train.micro_batch_size // layout.language.dp, packing=cfg.data.in_batch_packing)
    result = Evaluator(cfg, layout, pstate, ctx, runner, source, flag=flag).evaluate(0)
    if ctx.is_metrics_rank:
        taken = _taken_line(cfg, default_layout)
        if taken:  # one line; beside --json's object, not in it
            print(f"mimo-sft evaluate: {taken}", file=sys.stderr if as_json else sys.stdout, flush=True)
        what = {"checkpoint": ckpt, "hf_model": cfg.model.hf_model,
                "dataset": cfg.data.valid_dataset_path or dataset_label(cfg.data)}
        per_source = {name: {"loss": result.valid_sources.get(f"valid_loss/{name}"),
                             "tokens": result.valid_sources.get(f"valid_tokens/{name}")}
                      for name in getattr(source, "names", None) or []}
        if as_json:
            print(json.dumps({**what, "loss": result.valid_loss, "perplexity": result.valid_ppl,
                              "tokens": result.valid_tokens, "samples": result.valid_samples,
                              "time_s": result.valid_time_s, **({"sources": per_source} if per_source else {})}),
                  flush=True)
        else:
            print(f"mimo-sft evaluate: {ckpt or cfg.model.hf_model} on {what['dataset']}: loss {result.valid_loss:.6f} | "
                  f"perplexity {result.valid_ppl:.4f} | {result.valid_tokens:.0f} tokens in {result.valid_samples} "
                  f"samples | {result.valid_time_s:.1f} s", flush=True)
            for name, one in per_source.items():  # a validation set per source: each one's loss
                loss = "no supervised tokens" if one["loss"] is None else f"loss {one['loss']:.6f}"
                print(f"mimo-sft evaluate:   source {name}: {loss} | {one['tokens'] or 0:.0f} tokens", flush=True)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0
