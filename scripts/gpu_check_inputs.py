#!/usr/bin/env python
"""The GPU check's inputs: its model folders and its document rows (``scripts/gpu_check.sh`` calls this).

    python scripts/gpu_check_inputs.py WORK --mode gpu|rehearse [--only NAME ...] [--no-data]

Writes ``WORK/models/NAME`` for every model of the mode (``MODELS``; ``--only`` picks some, so that the GPU
machine can write them in parallel processes) and ``WORK/data.parquet`` (``DATA``): document-question rows
of one or two page images and an answer, in the usual ``messages`` + ``images`` parquet layout, the same
rows for mimo-sft and for transformers' reference run.

On the GPU the models are real architectures (``testing.tiny_checkpoint.PRESETS``: Qwen's real tokenizers,
config only, trained with ``--allow-random-init``) and the pages are 0.3-0.8 Mpx; in the rehearsal every
model is the family's tiny one and the pages are a few thousand pixels. ``mid`` (weights written) is
``check-model``'s: a mid-sized Qwen2.5-VL on the GPU (random weights, made here), the tiny one in the
rehearsal.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: mode -> name -> how to write it: ("preset", PRESET) or ("tiny", {write_tiny_checkpoint's options})
MODELS = {
    "gpu": {
        "qwen2_5_vl": ("preset", "qwen2.5-vl-3b"),
        "qwen3_5": ("preset", "qwen3.5-0.8b"),
        "qwen3_vl": ("preset", "qwen3-vl-2b-check"),
        "qwen3_vl_moe": ("preset", "qwen3-vl-moe-check"),
        "qwen3_5_moe": ("preset", "qwen3.5-moe-check"),
        "mid": ("tiny", dict(vision_hidden=256, vision_depth=4, vision_heads=4, text_hidden=1024, text_layers=8,
                             heads=16, kv_heads=4, intermediate=2816)),
    },
    "rehearse": {
        **{family: ("tiny", dict(family=family, config_only=True))
           for family in ("qwen2_5_vl", "qwen3_5", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe")},
        "mid": ("tiny", {}),
    },
}
#: mode -> rows, page pixels (low, high), answer words (low, high)
DATA = {"gpu": (160, (3e5, 8e5), (20, 400)), "rehearse": (40, (3e3, 1.2e4), (8, 40))}

WORDS = ("invoice total amount page table column row value date number item price tax sum account field header "
         "footer line paragraph figure caption section revenue cost quarter year report balance order").split()


def write_model(work: str, mode: str, name: str) -> str:
    """Write one model folder of ``MODELS[mode]``; return its path."""
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint, write_tiny_checkpoint

    kind, spec = MODELS[mode][name]
    out = os.path.join(work, "models", name)
    if kind == "preset":
        # every page of DATA fits Qwen's default 12.8-16.7 Mpx cap; the runs' --max-pixels keeps them whole
        write_preset_checkpoint(out, spec, config_only=True)
    else:
        write_tiny_checkpoint(out, **spec)
    print(f"gpu_check_inputs: {name} -> {out}", flush=True)
    return out


def _page(rng: random.Random, pixels: float) -> bytes:
    """A white JPEG page of about ``pixels`` pixels with dark noisy text lines of random length."""
    import numpy as np
    from PIL import Image

    aspect = rng.uniform(0.6, 1.0)
    w = max(32, int((pixels * aspect) ** 0.5))
    h = max(32, int(pixels / w))
    page = np.full((h, w, 3), 245, np.uint8)
    noise = np.random.default_rng(rng.randrange(2**32))
    step = max(6, h // 40)
    for y in range(step, h - step, step):
        x1 = rng.randint(w // 4, w - 4)
        page[y:y + step // 2, 4:x1] = noise.integers(0, 90, (step // 2, x1 - 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(page).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


def write_data(work: str, mode: str, seed: int = 0) -> str:
    """``DATA[mode]``'s rows as ``WORK/data.parquet``; return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, (lo_px, hi_px), (lo_w, hi_w) = DATA[mode]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        images = [{"bytes": _page(rng, rng.uniform(lo_px, hi_px)), "path": None}
                  for _ in range(1 if rng.random() < 0.75 else 2)]
        question = "What is the " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + " on this page?"
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo_w, hi_w))) + "."
        content = [{"type": "image", "text": None} for _ in images] + [{"type": "text", "text": question}]
        rows.append({"messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                     "images": images})
    path = os.path.join(work, "data.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"gpu_check_inputs: {n} rows -> {path}", flush=True)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work")
    p.add_argument("--mode", choices=sorted(MODELS), required=True)
    p.add_argument("--only", nargs="*", default=None, help="these models only (default: all of the mode)")
    p.add_argument("--no-data", action="store_true", help="do not write data.parquet")
    a = p.parse_args(argv)
    names = list(MODELS[a.mode]) if a.only is None else a.only
    unknown = sorted(set(names) - set(MODELS[a.mode]))
    if unknown:
        print(f"gpu_check_inputs: no model {', '.join(unknown)} in mode {a.mode}; choose from "
              f"{', '.join(MODELS[a.mode])}", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(a.work, "models"), exist_ok=True)
    if not a.no_data:
        write_data(a.work, a.mode)
    for name in names:
        write_model(a.work, a.mode, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
