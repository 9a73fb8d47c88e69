#!/usr/bin/env python
"""The peer a user would pick instead of mimo-sft: transformers' own Qwen-VL model in a plain torch loop, timed
on the same rows in the same order (the GPU check's ``hf`` stage).

    python scripts/hf_reference_run.py MODEL DATA.parquet OUT.json --mbs 2 --steps 20 --seq 4096 --lr 1e-5

The recipe is what transformers' Trainer does with ``bf16=True``: fp32 master weights, bf16 autocast, AdamW
(fused on CUDA), gradient clipping at 1.0; random init from MODEL's config (as mimo-sft's
``--allow-random-init``). A micro-batch is MBS consecutive rows padded on the right to the longest, with an
attention mask (SDPA): transformers' Qwen-VL packs rows only with flash-attention 2, which the GPU machine lacks.
Rows are tokenised here from the folder's own chat template, tokenizer and image processor, without mimo-sft's
data code, so that the two runs meet only in the parquet file: the loss covers the last assistant turn.

OUT.json: step times (device-synchronised), real (unpadded) and padded tokens per step, losses, tokens/s and
median step over the steps after the warm-up ones, peak allocated and reserved device memory (None on CPU).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time

import torch

IMAGE_PAD, IM_END, ASSISTANT = "<|image_pad|>", "<|im_end|>", "<|im_start|>assistant\n"


def _plain(messages: list) -> list:
    """parquet's message rows without the null fields a struct column fills in."""
    return [{"role": m["role"], "content": [{k: v for k, v in part.items() if v is not None} for part in m["content"]]}
            for m in messages]


def encode(row: dict, tok, image_processor, template: str, seq: int) -> dict:
    """One row as transformers' model takes it: ids with the image placeholders expanded, labels on the last
    assistant turn (-100 elsewhere), pixel values and grids."""
    from PIL import Image

    text = tok.apply_chat_template(_plain(row["messages"]), chat_template=template, tokenize=False)
    images = [Image.open(io.BytesIO(im["bytes"])).convert("RGB") for im in row["images"]]
    vis = image_processor(images=images, return_tensors="pt")
    merge = image_processor.merge_size ** 2
    pieces = text.split(IMAGE_PAD)
    text = pieces[0] + "".join(IMAGE_PAD * int(g.prod() // merge) + p
                               for g, p in zip(vis["image_grid_thw"], pieces[1:]))
    start = text.rindex(ASSISTANT) + len(ASSISTANT)
    end = text.index(IM_END, start) + len(IM_END)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = torch.tensor(enc["input_ids"][:seq])
    supervised = torch.tensor([start <= a and b <= end and b > a for a, b in enc["offset_mapping"][:seq]])
    return {"ids": ids, "labels": torch.where(supervised, ids, -100), "pixel_values": vis["pixel_values"],
            "image_grid_thw": vis["image_grid_thw"]}


def collate(samples: list, pad_id: int, image_id: int, device) -> tuple[dict, torch.Tensor, int, int]:
    """(model inputs, labels, real tokens, padded tokens) of rows padded on the right."""
    width = max(len(s["ids"]) for s in samples)
    ids = torch.full((len(samples), width), pad_id)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["ids"], s["labels"], 1
    inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == image_id).long(),
              "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
              "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples])}
    return ({k: v.to(device, non_blocking=True) for k, v in inputs.items()}, labels.to(device), int(mask.sum()),
            ids.numel())


def build(model_dir: str, attn: str, device):
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    return model.train()


def train(model, batches: list, lr: float, device) -> dict:
    """The loop; per step: seconds (synchronised), loss."""
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=cuda)
    times, losses = [], []
    for step, (inputs, labels, _, _) in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(**inputs).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        print(f"hf step {step + 1}/{len(batches)}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", flush=True)
    return {"step_times": times, "losses": losses}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s and the median step")
    p.add_argument("--attn", default="sdpa")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        import mimo_sft  # noqa: F401  (its import hook lets torchvision's Python side load beside the CPU torch)
    import pyarrow.parquet as pq
    from transformers import AutoImageProcessor, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.perf_counter()
    tok, image_processor = AutoTokenizer.from_pretrained(a.model), AutoImageProcessor.from_pretrained(a.model)
    template = open(f"{a.model}/chat_template.jinja").read()
    rows = pq.read_table(a.data).to_pylist()[: a.mbs * a.steps]
    samples = [encode(r, tok, image_processor, template, a.seq) for r in rows]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    batches = [collate(samples[i:i + a.mbs], pad_id, tok.convert_tokens_to_ids(IMAGE_PAD), device)
               for i in range(0, len(samples), a.mbs)]
    prep_s = time.perf_counter() - t0
    res = train(build(a.model, a.attn, device), batches, a.lr, device)
    warm = a.warmup if len(batches) > a.warmup + 1 else 0
    real = [b[2] for b in batches]
    res.update(attn=a.attn, mbs=a.mbs, steps=len(batches), prep_s=prep_s, real_tokens=real,
               padded_tokens=[b[3] for b in batches], warmup=warm,
               median_step_s=statistics.median(res["step_times"][warm:]),
               tokens_per_s=sum(real[warm:]) / sum(res["step_times"][warm:]),
               peak_allocated_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
               peak_reserved_bytes=torch.cuda.max_memory_reserved() if device.type == "cuda" else None)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
