"""The ``mimo-sft plan`` entry: parse the flags, build the plan, print it (table or JSON), write the PNG.

Why apart from :mod:`plan.build`: the figures are a pure function of the config and the data
(tests call ``build_plan`` directly); this is everything that talks to the terminal and the disk.
"""

from __future__ import annotations

import json
import os

from mimo_sft.errors import UserError
from mimo_sft.plan.build import build_plan
from mimo_sft.plan.flags import split_plan_args


def _quiet_progress_bars() -> None:
    """The plan is a report: keep datasets' "Generating train split" bars out of it (and of --json)."""
    try:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:  # pragma: no cover - datasets is a hard dependency of the data layer
        pass


def run_plan(args: list[str]) -> int:
    """CLI entry: parse, plan, print (table or JSON), write the PNG. UserError for user mistakes."""
    from mimo_sft.config.loader import load_config

    opts, rest = split_plan_args(list(args))
    cfg = load_config(rest)
    _quiet_progress_bars()
    plan = build_plan(cfg, opts)
    if opts.out:
        from mimo_sft.plan.report import write_png

        try:
            os.makedirs(opts.out, exist_ok=True)
        except OSError as err:
            raise UserError(f"--out {opts.out}: cannot create the folder ({err.strerror})") from None
        plan["png"] = write_png(plan, os.path.join(opts.out, "plan.png"))
        with open(os.path.join(opts.out, "plan.json"), "w") as fh:
            json.dump(plan, fh)
    if opts.as_json:
        print(json.dumps(plan))
    else:
        from mimo_sft.plan.report import print_plan

        print_plan(plan)
        memory = plan["memory_report"]
        if memory is not None:
            from mimo_sft.config.report import print_memory
            from mimo_sft.console import make_console

            console = make_console()
            print_memory(memory, console)
            for line in memory["problems"]:
                console.print(f"[red]x[/red] {line}", highlight=False, soft_wrap=True)
    return 0
