"""``mimo-sft finetune``: the entry point (thin; the loop is ``train.trainer.Trainer``, the start-up and
failure rules are ``train.launch``'s). Metrics come from the rank that owns the language loss.
"""

from __future__ import annotations

from mimo_sft.train.elastic import launch, split_launch_flags
from mimo_sft.train.launch import checked_config, launch_checked


def finetune(args: list[str]) -> int:
    opts, args = split_launch_flags(args)
    if opts is not None:  # mimo-sft's own launcher: check once, start the workers (train.elastic)
        return launch("finetune", opts, args,
                      check=lambda a, world: checked_config(a, world, refuse_reused_output_dir=True,
                                                           started_by=opts.started_by))
    return launch_checked(args, _train, refuse_reused_output_dir=True)


def _train(cfg, layout) -> int:
    from mimo_sft.train.trainer import Trainer

    return Trainer(cfg, layout).run()
