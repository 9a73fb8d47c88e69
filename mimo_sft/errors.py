"""The one exception type for user mistakes.

Anything a user can fix (a bad flag, a missing file, a layout megatron would reject) is raised as
``UserError``; the CLI prints its message as one line and exits with status 2, without a traceback.
Internal invariants use ``assert`` / ``RuntimeError`` and keep their tracebacks, because those are
our bugs, not the user's.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix. ``str(err)`` is one line: what is wrong and what to change."""

    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        #: every problem found, when several were collected at once (``validate`` reports them all)
        self.problems = list(problems) if problems else [message]
