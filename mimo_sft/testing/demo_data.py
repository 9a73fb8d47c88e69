"""A synthetic SFT dataset shaped like real document data, for demos, tests and benchmarks.

Why these choices: real document SFT sets are mostly small receipt-like images with a minority of
large pages, plus some multi-image and text-only samples; that skew is what makes vision load
unbalanced across DP ranks. The answer depends on the image (its colour and the number printed on
it) so a fine-tune can actually lower the loss. Written as parquet with ``messages`` + ``images``.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 215, 40),
    "orange": (245, 140, 20), "purple": (140, 50, 170), "black": (15, 15, 15), "white": (245, 245, 245),
}
QUESTIONS = ("What colour is shown in the image?", "Read the receipt and give the colour and number.",
             "Describe the image.", "What number is written on it?")

#: The sample mix, as cumulative thresholds on one uniform draw: 7% text-only, 8% multi-image,
#: 15% large pages, the rest (70%) small receipts. Roughly a real document SFT set's skew: a
#: minority of heavy samples is what unbalances vision load across DP ranks.
TEXT_ONLY_BELOW, MULTI_IMAGE_BELOW, LARGE_PAGE_BELOW = 0.07, 0.15, 0.30
#: Multi-image samples hold this many images (inclusive range).
MULTI_IMAGES = (2, 3)
#: Image sizes in pixels, (width range, height range). A large page reaches the tiny processor's
#: max_pixels; a receipt is narrow and maps to a handful of merged tokens.
LARGE_PAGE_SIZE = ((280, 420), (360, 560))
RECEIPT_SIZE = ((56, 100), (90, 180))
#: Spacing of the drawn "text lines" (pixels): the margin, the line pitch, the bottom margin.
LINE_MARGIN, LINE_PITCH, BOTTOM_MARGIN = 6, 14, 10
#: Operands of the text-only arithmetic questions and the number printed on an image (inclusive).
OPERANDS = (1, 50)
PRINTED_NUMBER = (0, 99)
#: ``long_answers=True``: the share of answers that get a long explanation, and the Pareto shape of
#: its sentence count (capped): most answers stay one sentence, a few run to hundreds of tokens --
#: the long tail of real SFT answer lengths that makes padding to the longest sample wasteful.
LONG_ANSWER_SHARE, LONG_ANSWER_PARETO, LONG_ANSWER_MAX_SENTENCES = 0.3, 1.2, 40


def image_png(rng: random.Random, width: int, height: int, colour: str, number: int) -> bytes:
    """A receipt-like PNG: ``colour`` background, a few random-length lines, ``number`` printed on it."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), COLOURS[colour])
    draw = ImageDraw.Draw(img)
    ink = (0, 0, 0) if colour in ("yellow", "white", "orange") else (255, 255, 255)
    for y in range(LINE_MARGIN, height - BOTTOM_MARGIN, LINE_PITCH):  # "text lines" of a receipt or page
        draw.line([(LINE_MARGIN, y), (LINE_MARGIN + rng.randint(width // 4, width - 2 * LINE_MARGIN), y)],
                  fill=ink, width=1)
    draw.text((width // 3, height // 3), str(number), fill=ink)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _size(rng: random.Random, kind: str) -> tuple[int, int]:
    (w_lo, w_hi), (h_lo, h_hi) = LARGE_PAGE_SIZE if kind == "doc" else RECEIPT_SIZE
    return rng.randint(w_lo, w_hi), rng.randint(h_lo, h_hi)


def _explanation(rng: random.Random) -> str:
    """A long-tailed run of filler sentences (empty for most samples)."""
    if rng.random() >= LONG_ANSWER_SHARE:
        return ""
    n = min(LONG_ANSWER_MAX_SENTENCES, int(rng.paretovariate(LONG_ANSWER_PARETO)))
    return "".join(f" Step {k + 1}: the {rng.choice(sorted(COLOURS))} line is checked." for k in range(n))


def make_sample(rng: random.Random, long_answers: bool = False) -> dict:
    sample = _make_sample(rng)
    if long_answers:
        sample["messages"][1]["content"][0]["text"] += _explanation(rng)
    return sample


def _make_sample(rng: random.Random) -> dict:
    r = rng.random()
    kind = ("text" if r < TEXT_ONLY_BELOW else "multi" if r < MULTI_IMAGE_BELOW
            else "doc" if r < LARGE_PAGE_BELOW else "small")
    if kind == "text":
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": f"What is {a} plus {b}?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": f"{a} plus {b} is {a + b}."}]}],
                "images": []}
    n_img = rng.randint(*MULTI_IMAGES) if kind == "multi" else 1
    images, facts = [], []
    for _ in range(n_img):
        colour, number = rng.choice(sorted(COLOURS)), rng.randint(*PRINTED_NUMBER)
        w, h = _size(rng, "doc" if kind == "doc" else "small")
        images.append({"bytes": image_png(rng, w, h, colour, number), "path": None})
        facts.append((colour, number))
    if n_img == 1:
        question = rng.choice(QUESTIONS)
        answer = f"The colour is {facts[0][0]} and the number is {facts[0][1]}."
    else:
        question = "List the colour and number of each picture."
        answer = " ".join(f"Picture {i + 1}: {c}, {n}." for i, (c, n) in enumerate(facts))
    content = [{"type": "image", "text": None} for _ in images] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": images}


def write_demo_dataset(out: str | os.PathLike, *, samples: int, seed: int = 0, long_answers: bool = False) -> Path:
    """Write ``samples`` rows; ``out`` ending in .parquet is the file, else a folder with train.parquet.

    ``long_answers``: give about a third of the answers a long-tailed explanation (benchmarks of
    padding vs packing); off, the rows are exactly the demo's.
    """
    import datasets

    rows = demo_rows(samples, seed=seed, long_answers=long_answers)
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"),
                                   "content": datasets.List({"type": datasets.Value("string"),
                                                             "text": datasets.Value("string")})}),
        "images": datasets.List(datasets.Image()),
    })
    ds = datasets.Dataset.from_list(rows, features=features)
    out = Path(out)
    path = out if out.suffix == ".parquet" else out / "train.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))
    return out


def write_shards(rows: list[dict], out: str | os.PathLike, *, shards: int, kind: str = "parquet",
                 row_group_rows: int = 64) -> list[Path]:
    """``rows`` (``make_sample``'s form) as ``shards`` shard files in folder ``out``, in row order:
    parquet (``row_group_rows`` rows a row group, the demo's features) or WebDataset tars (a sample
    is ``<key>.json`` with its messages plus ``<key>.<i>.png`` per image). Streamed-source tests and
    ``scripts/bench_data_scale.py`` read them in place."""
    import json
    import tarfile

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bounds = [len(rows) * k // shards for k in range(shards + 1)]
    files = []
    for k in range(shards):
        part = rows[bounds[k]:bounds[k + 1]]
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = out / f"train-{k:05d}-of-{shards:05d}.parquet"
            pq.write_table(pa.Table.from_pylist(part), str(path), row_group_size=row_group_rows)
        elif kind == "webdataset":
            path = out / f"shard-{k:06d}.tar"
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
                for j, row in enumerate(part):
                    key = f"{bounds[k] + j:09d}"
                    members = [(f"{key}.json", json.dumps({"messages": row["messages"]}).encode())]
                    members += [(f"{key}.{i}.png", img["bytes"]) for i, img in enumerate(row["images"])]
                    for name, data in members:
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        else:
            raise ValueError(f"shard kind {kind!r}: parquet or webdataset")
        files.append(path)
    return files


def demo_rows(samples: int, *, seed: int = 0, long_answers: bool = False) -> list[dict]:
    """``samples`` rows of the demo dataset (``write_demo_dataset`` writes the same rows)."""
    rng = random.Random(seed)
    return [make_sample(rng, long_answers) for _ in range(samples)]


# ---- document-VQA rows: the GPU benchmark's data (docs/benchmarks.md) ---------------------------------------
DOC_WORDS = ("total amount invoice page table column row value date number item price tax sum account field header "
             "footer line paragraph figure caption section revenue cost quarter year report").split()


def document_page(rng: random.Random, pixels: float) -> bytes:
    """A JPEG page of about ``pixels`` pixels (aspect 0.6-1): light paper with dark text-like stripes."""
    import numpy as np
    from PIL import Image

    w = int((pixels * rng.uniform(0.6, 1.0)) ** 0.5)
    h = int(pixels / w)
    a = np.full((h, w, 3), 245, np.uint8)
    noise = np.random.default_rng(rng.randrange(1 << 30))
    for y in range(20, h - 20, 18):
        x1 = rng.randint(w // 3, w - 20)
        a[y:y + 9, 20:x1] = noise.integers(0, 90, (9, x1 - 20, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


def write_document_rows(path: str | os.PathLike, rows: int, *, seed: int = 0) -> Path:
    """``rows`` document-VQA-like rows as one parquet file (``messages`` + ``images``): 1 page (3 in 4 rows) or 2
    of 0.3-0.8 Mpx, a question of 4-20 words, an answer of 20-400 -- what the GPU benchmark trained on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        images = [{"bytes": document_page(rng, rng.uniform(3e5, 8e5)), "path": None}
                  for _ in range(1 if rng.random() < 0.75 else 2)]
        question = "Read the document and answer: what is the " + " ".join(
            rng.choice(DOC_WORDS) for _ in range(rng.randint(4, 20))) + "?"
        answer = " ".join(rng.choice(DOC_WORDS) for _ in range(rng.randint(20, 400))) + "."
        content = [{"type": "image", "text": None} for _ in images] + [{"type": "text", "text": question}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                    "images": images})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(out), str(path))
    return Path(path)
