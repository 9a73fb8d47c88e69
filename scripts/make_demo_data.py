#!/usr/bin/env python
"""Write a synthetic document-like SFT dataset (parquet: messages + images).

    python scripts/make_demo_data.py OUT --samples N [--seed S] [--long-answers]

OUT ending in .parquet is the file; otherwise a folder holding train.parquet. See
``mimo_sft.testing.demo_data`` for the mix (small receipts, some large pages, multi-image, text-only).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-answers", action="store_true",
                   help="give about a third of the answers a long-tailed explanation (padding vs packing benchmarks)")
    a = p.parse_args(argv)
    if a.samples <= 0:
        print("error: --samples must be positive", file=sys.stderr)
        return 2
    from mimo_sft.testing.demo_data import write_demo_dataset

    out = write_demo_dataset(a.out, samples=a.samples, seed=a.seed, long_answers=a.long_answers)
    print(f"wrote {a.samples} samples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
