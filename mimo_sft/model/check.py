"""check-model: does our megatron MimoModel reproduce transformers' logits for a checkpoint folder?

Both sides load the same folder (transformers: ``AutoModelForImageTextToText``, eager attention, fp32;
ours: ``build_single_process_model`` with the SDPA attention core training uses, fp32) on this process's device -- one after the other, so only
one copy of the model is ever resident -- and run one random batch built from config.json alone
(no processor needed): several images of different sizes, one text-only sample, right padding, rows
past 64 tokens (one chunk of a Gated DeltaNet's delta rule: the state is carried across chunks),
``mm_token_type_ids`` for transformers and the same mRoPE positions for megatron. We report the
largest relative logit difference over real tokens (max|ours - hf| / max|hf|) and the loss
difference; ``ok`` when both are <= ``tolerance``.
"""

from __future__ import annotations

import time

import torch

from mimo_sft.model.family import modality_inputs_from_batch

DEFAULT_TOLERANCE = 1e-5
#: leading text tokens of each random row: with the images, every row runs past one 64-token chunk
CHECK_TEXT_TOKENS = 70


def random_batch(hf_cfg, *, seed: int = 0, images_per_sample=((1, 1),), image_grids=None, text_only: int = 1,
                 text_len: int = 7) -> dict:
    """A design.md-style micro-batch for ``hf_cfg`` with random pixels and tokens.

    ``image_grids``: per sample with images, the list of (h, w) grids in patches (multiples of the
    merge size). Default: sample 0 has one 4x4 image, sample 1 a 4x6 and a 2x2 image; then
    ``text_only`` samples without images. Rows are right-padded with token 0.
    """
    g = torch.Generator().manual_seed(seed)
    v = hf_cfg.vision_config
    merge = v.spatial_merge_size
    if image_grids is None:
        image_grids = [[(2 * merge, 2 * merge)], [(2 * merge, 3 * merge), (merge, merge)]]
    # the pad token too: transformers' embedding has ``padding_idx`` = pad_token_id, so its row never gets a
    # gradient there (megatron's embedding trains it); random text must not draw it
    specials = {hf_cfg.image_token_id, hf_cfg.vision_start_token_id, hf_cfg.vision_end_token_id,
                getattr(hf_cfg, "video_token_id", -1), getattr(hf_cfg.text_config, "pad_token_id", None)}
    vocab = hf_cfg.text_config.vocab_size
    normal = torch.tensor([t for t in range(1, vocab) if t not in specials])

    def text(n):
        return normal[torch.randint(len(normal), (n,), generator=g)].tolist()

    seqs, types, grids, counts = [], [], [], []
    for grids_i in list(image_grids) + [[] for _ in range(text_only)]:
        ids, tt = text(text_len), [0] * text_len
        for (h, w) in grids_i:
            n = (h * w) // (merge * merge)
            ids += [hf_cfg.vision_start_token_id] + [hf_cfg.image_token_id] * n + [hf_cfg.vision_end_token_id] + text(3)
            tt += [0] + [1] * n + [0] + [0] * 3
            grids.append((1, h, w))
        seqs.append(ids)
        types.append(tt)
        counts.append(len(grids_i))
    S = max(len(s) for s in seqs) + 2
    B = len(seqs)
    input_ids = torch.zeros(B, S, dtype=torch.long)
    mm = torch.zeros(B, S, dtype=torch.long)
    attn = torch.zeros(B, S, dtype=torch.bool)
    for b, (ids, tt) in enumerate(zip(seqs, types)):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        mm[b, : len(tt)] = torch.tensor(tt)
        attn[b, : len(ids)] = True
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    loss_mask = torch.zeros(B, S)
    loss_mask[:, :-1] = attn[:, 1:].float()
    batch = dict(input_ids=input_ids, labels=labels, loss_mask=loss_mask, attention_mask=attn, mm_token_type_ids=mm,
                 image_counts=torch.tensor(counts), sample_ids=torch.arange(B))
    if grids:
        thw = torch.tensor(grids, dtype=torch.long)
        patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        batch["image_grid_thw"] = thw
        batch["pixel_values"] = torch.randn(int(thw.prod(-1).sum()), patch_dim, generator=g)
    return batch


def hf_position_ids(hf_model, batch: dict) -> torch.Tensor:
    """mRoPE positions ``[3, B, S]`` exactly as transformers computes them."""
    pos, _ = hf_model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                           image_grid_thw=batch.get("image_grid_thw"),
                                           attention_mask=batch["attention_mask"].long())
    return pos


def hf_forward(hf_model, batch: dict):
    """transformers' logits ``[B, S, V]`` and loss (labels = input_ids, pads ignored)."""
    hf_labels = batch["input_ids"].masked_fill(~batch["attention_mask"], -100)
    with torch.no_grad():
        out = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                       pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
                       mm_token_type_ids=batch["mm_token_type_ids"], labels=hf_labels)
    return out.logits, out.loss


def mimo_forward(model, info, batch: dict, position_ids: torch.Tensor, *, labels: bool = False):
    """Our colocated MimoModel: logits ``[B, S, V]`` (vocab padding removed) or per-token loss ``[B, S]``."""
    with torch.no_grad():
        out, _ = model(input_ids=batch["input_ids"], position_ids=position_ids, attention_mask=None,
                       loss_mask=batch["loss_mask"], labels=batch["labels"] if labels else None,
                       modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
    return out if labels else out[..., : info.vocab_size]


def compare(ours: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """max|ours - ref| / max|ref| over positions where ``mask`` is True."""
    a, b = ours[mask].double(), ref[mask].double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_model(hf_dir: str, *, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> dict:
    """Compare our model with transformers on one random batch; see the module docstring."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.config.families import family_for_model_type
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.registry import get_family
    from mimo_sft.model.hf_checkpoint import HFCheckpoint, read_config_json
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.bootstrap import start_single_process

    t0 = time.time()
    start_single_process()  # chooses the device and sets megatron up, as training does
    device = runtime.device()
    raw = read_config_json(hf_dir)
    HFCheckpoint(hf_dir)  # safetensors only, refused in one line before transformers opens the folder
    hf_cfg = get_family(raw, hf_dir=hf_dir).load_hf_config(hf_dir, raw)
    host = random_batch(hf_cfg, seed=seed, text_len=CHECK_TEXT_TOKENS)
    batch = {k: v.to(device) for k, v in host.items()}
    # transformers first; keep only its outputs (on the host) before building ours
    hf_model = AutoModelForImageTextToText.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32,
                                                           use_safetensors=True)
    hf_model.to(device).eval()
    ref_logits, ref_loss = (t.cpu() for t in hf_forward(hf_model, batch))
    pos = hf_position_ids(hf_model, batch)
    del hf_model
    runtime.release_cached_memory()
    model, info = build_single_process_model(hf_dir)
    model.to(device).eval()
    ours = dict(batch, image_grid_thw=host["image_grid_thw"])  # the tower plans from a host grid, as in training
    logits = mimo_forward(model, info, ours, pos).cpu()
    per_token = mimo_forward(model, info, ours, pos, labels=True)
    loss = float((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    rel = compare(logits, ref_logits, batch["attention_mask"].cpu())
    loss_diff = abs(loss - float(ref_loss))
    ok = rel <= tolerance and loss_diff <= tolerance * max(1.0, abs(float(ref_loss)))
    report = dict(ok=bool(ok), max_rel_logit_diff=rel, loss=loss, hf_loss=float(ref_loss), loss_diff=loss_diff,
                  tolerance=tolerance, family=info.family, batch_size=int(batch["input_ids"].shape[0]),
                  seq_length=int(batch["input_ids"].shape[1]), num_images=int(batch["image_grid_thw"].shape[0]),
                  hf_model=hf_dir, seconds=round(time.time() - t0, 3))
    if family_for_model_type(raw.get("model_type")).architecture.hybrid_gdn:  # which kernels were compared
        from mimo_sft.model.gdn_binding import installed_choice

        report["gdn_kernels"] = installed_choice().line()
    return report
