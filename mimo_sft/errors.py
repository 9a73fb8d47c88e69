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


class BadSampleError(UserError):
    """One dataset sample that cannot be trained on (unreadable or oversized image, a directory where an
    image should be, placeholders that do not match the images, ...). It names the sample and file, so a
    run can skip it and count it (``--max-bad-samples``) or refuse with a line the user can act on."""

    def __init__(self, index: int | None, path: str | None, reason: str):
        where = f"sample {index}" if index is not None else "a sample"
        if path:
            where += f" ({path})"
        super().__init__(f"{where}: {reason}")
        self.index = index
        self.path = path
        self.reason = reason


class BadRowError(BadSampleError):
    """A row that cannot be trained on as written (a content part of an unsupported type such as video, a
    message without a role, image parts that name no image, a tar sample whose images are missing, a remote
    URL). It is known from the row alone, so every rank that reads the row agrees: with ``--max-bad-samples``
    > 0 the row is skipped (the next row of its source stands in) and counted, like an unreadable image.
    ``path`` names where the row is (the file, or the shard and its row)."""

    stage = "row"
