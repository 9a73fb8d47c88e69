"""Summarise a run folder's metrics.jsonl: ``mimo-sft summarize RUN_DIR`` (loss curve ends, vision-load spread,
speed, the per-rank table and its plot).

    .venv/bin/python scripts/summarize_run.py RUN_DIR
Exits non-zero if the run has no metrics (so `make demo` fails loudly when training did not run).
"""

from __future__ import annotations

import sys

from mimo_sft.errors import UserError
from mimo_sft.summary import summarize


def main() -> int:
    try:
        print("\n".join(summarize(sys.argv[1])))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
