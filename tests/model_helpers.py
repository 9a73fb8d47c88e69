"""Tiny checkpoints built in memory, the per-rank bodies of the model parity tests, and the setup the
one-process family tests share.

Checkpoints are written with transformers' own ``save_pretrained`` (optionally re-sharded with an
index, or renamed to the ``model.visual.*`` / ``model.language_model.*`` layout) so the loader sees
exactly what users have on disk. Weights use a larger init range than HF's default so a layout bug
moves the logits visibly; :func:`perturbed_tiny_checkpoint` does the same for any family's tiny
checkpoint, and :func:`hf_and_mimo` / :func:`trained_lora_model` build what its tests compare.
"""

from __future__ import annotations

import json
import os

import torch


def make_tiny_hf(out_dir: str, *, heads: int = 4, kv_heads: int = 2, hidden: int = 64, layers: int = 2,
                 ffn: int = 96, vocab: int = 160, tie: bool = False, vision_hidden: int = 32, vision_heads: int = 2,
                 vision_depth: int = 2, seed: int = 0, layout: str = "legacy", shards: int = 1,
                 flat_config: bool = False) -> str:
    """Write a random tiny Qwen2.5-VL checkpoint to ``out_dir`` and return it.

    ``flat_config`` rewrites config.json the way hub checkpoints store it (text settings at the top
    level, ``rope_scaling: {type: mrope, mrope_section}``, ``rope_theta``).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = hidden // heads
    half = head_dim // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope},
                         max_position_embeddings=1024, initializer_range=0.08, bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_heads=vision_heads, out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[vision_depth - 1],
                           initializer_range=0.08),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():  # norms away from 1 and biases away from 0 so they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    if layout == "nested" or shards > 1:
        _rewrite(out_dir, layout=layout, shards=shards)
    if flat_config:
        _flatten_config(out_dir)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:  # a side file export must copy
        json.dump({"note": "side file"}, f)
    return out_dir


def _flatten_config(out_dir: str) -> None:
    path = os.path.join(out_dir, "config.json")
    cfg = json.load(open(path))
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type", None)
    text.pop("layer_types", None)
    cfg.update(text)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    cfg["vision_config"]["model_type"] = "qwen2_5_vl"  # what older hub configs say
    json.dump(cfg, open(path, "w"), indent=2)


def _rewrite(out_dir: str, *, layout: str, shards: int) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    os.remove(path)
    if layout == "nested":
        renamed = {}
        for k, v in tensors.items():
            if k.startswith("visual."):
                k = "model." + k
            elif k.startswith("model."):
                k = "model.language_model." + k[len("model."):]
            renamed[k] = v
        tensors = renamed
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path, metadata={"format": "pt"})
        return
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i * per:(i + 1) * per]}
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def hf_reference(hf_dir: str, batch: dict):
    """transformers' logits and mRoPE positions for ``batch`` (eager attention, fp32)."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model.check import hf_forward, hf_position_ids

    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    logits, loss = hf_forward(hf, batch)
    return logits, loss, hf_position_ids(hf, batch)


def _layout(*flags):
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.layout import Layout

    return Layout.from_specs([parse_component(f) for f in flags])


def _gather_vocab(logits: torch.Tensor, tp_group) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(logits) for _ in range(tp_group.size())]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def uniform_batch(hf_cfg, seed: int = 3) -> dict:
    """Two samples with the same image-token count: the parity worker drives megatron's bare colocated
    bridge, which splits evenly (training wraps it in ``train.bridge.PaddedBridge`` for any counts)."""
    from mimo_sft.model.check import random_batch

    m = hf_cfg.vision_config.spatial_merge_size
    return random_batch(hf_cfg, seed=seed, image_grids=[[(2 * m, 2 * m)], [(m, 2 * m), (2 * m, m)]], text_only=0)


def worker_tp2_colocated(rank: int, world: int, hf_dir: str, ref_path: str) -> float:
    """language tp=2 on ranks 0-1, images dp=2 colocated: each encoder rank encodes its own sample."""
    from mimo_sft.model.builder import build_mimo_model
    from mimo_sft.model.check import compare
    from mimo_sft.model.family import modality_inputs_from_batch
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.train.setup import megatron_ranks

    layout = _layout("language=tp=2,dp=1", "images=dp=2")
    state = build_parallel_state(layout)
    runtime.init_megatron(0, **megatron_ranks(state))
    model, info = build_mimo_model(hf_dir, layout=layout, parallel_state=state)
    model.eval()
    ref = torch.load(ref_path)
    batch = ref["batch"]
    # encoder DP rank r holds sample r's images (one image row block per sample, in order)
    thw = batch["image_grid_thw"]
    counts = batch["image_counts"].tolist()
    img0 = sum(counts[:rank])
    patches = thw.prod(-1)
    p0 = int(patches[:img0].sum())
    p1 = p0 + int(patches[img0:img0 + counts[rank]].sum())
    local = dict(pixel_values=batch["pixel_values"][p0:p1], image_grid_thw=thw[img0:img0 + counts[rank]])
    with torch.no_grad():
        logits, _ = model(input_ids=batch["input_ids"], position_ids=ref["pos"], attention_mask=None,
                          modality_inputs=modality_inputs_from_batch(local, info.encoder_name))
    full = _gather_vocab(logits, state.modules["language"].pg_collection.tp)[..., : info.vocab_size]
    return compare(full, ref["logits"], batch["attention_mask"])


def _non_colocated_setup(hf_dir: str, ref_path: str, *components):
    """Model, bridge communicator and reference batch for a non-colocated parity worker."""
    from mimo_sft.model.builder import build_mimo_model
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.train.setup import megatron_ranks

    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator

    layout = _layout(*components)
    state = build_parallel_state(layout)
    runtime.init_megatron(0, **megatron_ranks(state))
    model, info = build_mimo_model(hf_dir, layout=layout, parallel_state=state)
    model.eval()
    comm = MultiModulePipelineCommunicator(state.grids, {"images": ["language"], "language": []},
                                           info.language_config, dim_mapping={"s": 0, "b": 1, "h": 2},
                                           module_output_ndim={"images": 2})
    ref = torch.load(ref_path)
    return model, info, comm, ref, ref["batch"]


def worker_non_colocated(rank: int, world: int, hf_dir: str, ref_path: str):
    """language on rank 0, images on rank 1: encoder output crosses megatron's bridge communicator."""
    from mimo_sft.model.check import compare
    from mimo_sft.model.family import modality_inputs_from_batch

    model, info, comm, ref, batch = _non_colocated_setup(hf_dir, ref_path, "language=dp=1", "images=dp=1,rank_offset=1")
    with torch.no_grad():
        if rank == 1:
            assert model.language_model is None and "images" in model.modality_submodules
            out, _ = model(input_ids=batch["input_ids"], modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
            comm.send_forward(out)
            return None
        assert model.language_model is not None and len(model.modality_submodules) == 0
        model.set_input_tensor(comm.recv_forward())
        logits, _ = model(input_ids=batch["input_ids"], position_ids=ref["pos"], attention_mask=None)
    return compare(logits[..., : info.vocab_size], ref["logits"], batch["attention_mask"])


def worker_pp2_non_colocated(rank: int, world: int, hf_dir: str, ref_path: str):
    """language pp=2 on ranks 0-1, images on rank 2: encoder -> bridge -> stage 0 -> p2p -> stage 1."""
    from mimo_sft.model.check import compare
    from mimo_sft.model.family import modality_inputs_from_batch

    model, info, comm, ref, batch = _non_colocated_setup(hf_dir, ref_path, "language=pp=2,dp=1", "images=dp=1,rank_offset=2")
    B, S = batch["input_ids"].shape
    with torch.no_grad():
        if rank == 2:
            out, _ = model(input_ids=batch["input_ids"], modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
            comm.send_forward(out)
            return None
        if rank == 0:
            model.set_input_tensor(comm.recv_forward())
            out, _ = model(input_ids=batch["input_ids"], position_ids=ref["pos"], attention_mask=None)
            assert set(out) == {"language"} and out["language"].shape == (S, B, info.hidden_size)
            comm.send_forward(out)
            return None
        model.set_input_tensor(comm.recv_forward(tensor_shape=(S, B, info.hidden_size)))
        logits, _ = model(input_ids=batch["input_ids"], position_ids=ref["pos"], attention_mask=None)
    return compare(logits[..., : info.vocab_size], ref["logits"], batch["attention_mask"])


def perturbed_tiny_checkpoint(tmp_path_factory, family: str, *, text_layers: int, norm_scale: float = 0.1,
                              edit_config=None) -> str:
    """A tiny ``family`` checkpoint (``testing.tiny_checkpoint``: 2 vision blocks, 2 KV heads, untied) with
    every tensor moved away from its init, so a wrong layout or a missing tensor shows in the logits.

    Routers and shared-expert gates move by 0.5 (routing far from uniform), norms (zero-centred ones are 0
    at init), biases, ``A_log`` and ``dt_bias`` by ``norm_scale``, every other weight by 0.03 (seed 1).
    ``edit_config`` changes the config.json dict before transformers reads the model back."""
    import json

    from mimo_sft.model.registry import get_family
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path_factory.mktemp(family) / "m", family=family, text_layers=text_layers,
                                vision_depth=2, tie_embeddings=False, kv_heads=2)
    if edit_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    model_class = get_family({"model_type": family}, hf_dir=str(out)).hf_model_class()
    model = model_class.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            moved = "norm" in name or name.endswith(("bias", "A_log", "dt_bias"))
            scale = 0.5 if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else (
                norm_scale if moved else 0.03)
            p.add_(scale * torch.randn_like(p))
    model.save_pretrained(str(out))
    return str(out)


def hf_eager(hf_dir: str):
    """transformers' model of ``hf_dir`` as the comparisons run it: eager attention, fp32, eval mode."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(hf_dir, attn_implementation="eager",
                                                       dtype=torch.float32).eval()


def hf_and_mimo(hf_dir: str):
    """(transformers' model, ours from ``build_single_process_model``, its ``ModelInfo``), both in eval mode."""
    from mimo_sft.model.builder import build_single_process_model

    hf = hf_eager(hf_dir)
    ours, info = build_single_process_model(hf_dir)
    return hf, ours.eval(), info


def trained_lora_model(hf_dir: str):
    """(our model of ``hf_dir`` with the default LoRA targets, every trainable tensor moved by 0.05 so B is
    away from 0 and a mapping mistake shows; its info; the spec, rank 2 and alpha 6 so a wrong scaling shows),
    in eval mode."""
    from mimo_sft.config.lora import DEFAULT_TARGETS, LoraSpec, split_targets
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.lora import apply_lora

    model, info = build_single_process_model(hf_dir)
    spec = LoraSpec(2, 6.0, 0.0, tuple(split_targets(DEFAULT_TARGETS)))
    apply_lora(model, spec, seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval(), info, spec
