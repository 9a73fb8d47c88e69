"""Summarise a run folder's metrics.jsonl: ``mimo-sft summarize RUN_DIR`` (loss curve ends, vision-load spread,
speed, the per-rank table and its plot).

    .venv/bin/python scripts/summarize_run.py RUN_DIR
Exits non-zero if the run has no metrics (so `make demo` fails loudly when training did not run).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mimo_sft.errors import UserError  # noqa: E402
from mimo_sft.summary import summarize  # noqa: E402


def main() -> int:
    try:
        print("\n".join(summarize(sys.argv[1])))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
