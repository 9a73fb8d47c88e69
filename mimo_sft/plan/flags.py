"""``mimo-sft plan``'s own flags (``--steps``, ``--out``, ``--json``, ``--compare-*``) and their parsing.

Why apart from the figures: the flags are stripped before the shared config flags reach
``load_config``, so parsing them is a pure step of its own (unit-tested without a config or data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimo_sft.errors import UserError

DEFAULT_STEPS = 50


@dataclass
class PlanOptions:
    steps: int = DEFAULT_STEPS
    out: str | None = None
    as_json: bool = False
    windows: list[int] = field(default_factory=list)
    language_weights: list[float] = field(default_factory=list)


def _parse_list(flag: str, text: str, kind):
    try:
        values = [kind(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated {'integers' if kind is int else 'numbers'}, "
                        f"e.g. {'1,2,4' if kind is int else '0,0.5'}") from None
    if not values:
        raise UserError(f"{flag} needs at least one value")
    return values


def split_plan_args(args: list[str]) -> tuple[PlanOptions, list[str]]:
    """Take plan's own flags out of ``args``; the rest are the shared config flags."""
    opts, rest = PlanOptions(), []
    valued = {"--steps", "--out", "--compare-window", "--compare-cost-weights"}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name == "--json" and not eq:
            opts.as_json = True
        elif name in valued:
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise UserError(f"{name} needs a value")
            if name == "--steps":
                try:
                    opts.steps = int(value)
                except ValueError:
                    raise UserError(f"--steps {value!r}: expected an integer number of micro-batches") from None
                if opts.steps < 1:
                    raise UserError(f"--steps {opts.steps} must be >= 1")
            elif name == "--out":
                opts.out = value
            elif name == "--compare-window":
                opts.windows = _parse_list(name, value, int)
                if min(opts.windows) < 1:
                    raise UserError(f"--compare-window {value}: window sizes must be >= 1")
            else:
                opts.language_weights = _parse_list(name, value, float)
                if min(opts.language_weights) < 0:
                    raise UserError(f"--compare-cost-weights {value}: language cost weights must be >= 0")
        else:
            rest.append(arg)
        i += 1
    return opts, rest
