"""``mimo-sft finetune``: the entry point (thin; the loop is ``train.trainer.Trainer``, the start-up and
failure rules are ``train.launch``'s). Metrics come from the rank that owns the language loss.
"""

from __future__ import annotations

from mimo_sft.train.launch import launch_checked


def finetune(args: list[str]) -> int:
    return launch_checked(args, _train, refuse_reused_output_dir=True)


def _train(cfg, layout) -> int:
    from mimo_sft.train.trainer import Trainer

    return Trainer(cfg, layout).run()
