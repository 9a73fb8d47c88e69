"""The one way mimo-sft makes a rich ``Console``: on a terminal rich's own behaviour, elsewhere no wrapping.

Why: written to a file or a pipe (a log, CI, ``| tee``), rich falls back to 80 columns and shrinks
table columns to fit, so the memory table's headers came out as ``mo…``, ``we…``. A log must hold
what was printed, whole. Off a terminal the console is therefore given a width wider than anything
mimo-sft prints: tables are not set to expand, so they keep their natural width, and plain lines stay
the single lines they were (nothing is padded to the width). ``COLUMNS`` in the environment, an
explicit ``width=``, or a console rich treats as a terminal (a tty, ``FORCE_COLOR``,
``TTY_COMPATIBLE=1``) keep rich's behaviour.
"""

from __future__ import annotations

import os

from rich.console import Console

#: the width off a terminal: more than any line or table mimo-sft prints (the memory table is ~130)
NO_WRAP_WIDTH = 4000


def make_console(*, pipe_width: int | None = None, **kwargs) -> Console:
    """A ``rich.console.Console(**kwargs)``; off a terminal (without ``COLUMNS`` or ``width=``) it is
    ``pipe_width`` columns wide, by default :data:`NO_WRAP_WIDTH`."""
    console = Console(**kwargs)
    if kwargs.get("width") is None and not os.environ.get("COLUMNS") and not console.is_terminal:
        console.width = pipe_width or NO_WRAP_WIDTH
    return console
