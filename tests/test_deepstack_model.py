"""DeepStack inside the language model, one process: recomputed layers add their own micro-batch's
features, and the features' gradient reaches the encoder's DeepStack mergers exactly once.

Two micro-batches (different images, image sizes and tokens) run as megatron's 1F1B schedule runs
them on a pipeline stage -- forward 0, forward 1, backward 0, backward 1 -- so a recomputed layer
of micro-batch 0 runs after micro-batch 1's forward. Every recompute method must give the plain
run's per-token losses and every parameter's gradient (fp32, relative 1e-6) on the tiny Qwen3-VL.
The multi-rank layouts (bridges, tp 2 with sequence parallelism, pp 2, packing, LoRA) are in
``test_deepstack_e2e.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xdist_group("recompute")

FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL_ONE_GROUP = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4)
FULL_BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules="core_attn,mlp")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from mimo_sft.model.check import hf_position_ids, random_batch
    from mimo_sft.model.registry import get_family
    from mimo_sft.model.hf_checkpoint import read_config_json
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    hf_dir = str(write_tiny_checkpoint(tmp_path_factory.mktemp("deepstack") / "q3", family="qwen3_vl", text_layers=4))
    raw = read_config_json(hf_dir)
    cfg = get_family(raw, hf_dir=hf_dir).load_hf_config(hf_dir, raw)
    assert len(cfg.vision_config.deepstack_visual_indexes) == 2  # layers 0 and 1 of 4 get features
    m = cfg.vision_config.spatial_merge_size
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    batches = []
    for seed, grids in ((1, [[(2 * m, 3 * m)], [(m, m), (3 * m, m)]]), (2, [[(m, 2 * m)], [(2 * m, 2 * m)]])):
        batch = random_batch(cfg, seed=seed, image_grids=grids, text_only=1, text_len=5)
        batch["position_ids"] = hf_position_ids(hf, batch)
        batches.append(batch)
    return hf_dir, batches


def _steps(hf_dir: str, batches: list, *, interleaved: bool, **settings):
    """Per-token losses and every parameter's gradient of the micro-batches' forwards and backwards,
    as 1F1B orders them (all forwards, then the backwards in order) or one after another."""
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.family import modality_inputs_from_batch

    model, info = build_single_process_model(hf_dir, model_cfg=ModelConfig(hf_model=hf_dir, **settings),
                                             config_overrides={"calculate_per_token_loss": True})
    model.train()

    def forward(batch):
        out, mask = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                          loss_mask=batch["loss_mask"], labels=batch["labels"],
                          modality_inputs=modality_inputs_from_batch(batch, info.encoder_name))
        return out, mask

    losses = []
    if interleaved:
        pending = [forward(b) for b in batches]
        for out, mask in pending:
            (out * mask).sum().backward()
            losses.append(out.detach()[mask.bool()])
    else:
        for b in batches:
            out, mask = forward(b)
            (out * mask).sum().backward()
            losses.append(out.detach()[mask.bool()])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(losses), grads


def _assert_same(ref, got, *, rel=1e-6):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    torch.testing.assert_close(loss, ref_loss, rtol=rel, atol=0)
    assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
    for name, g in ref_grads.items():
        scale = float(g.abs().max())
        diff = float((grads[name].double() - g.double()).abs().max())
        assert diff <= rel * scale + 1e-12, f"{name}: gradient differs by {diff} (largest entry {scale})"


@pytest.fixture(scope="module")
def plain(setup):
    hf_dir, batches = setup
    ref = _steps(hf_dir, batches, interleaved=False)
    deepstack = [n for n, g in ref[1].items() if "deepstack_merger_list" in n]
    assert deepstack and all(ref[1][n].abs().max() > 0 for n in deepstack), "the DeepStack mergers get a gradient"
    return ref


@pytest.mark.parametrize("settings", [{}, FULL_UNIFORM, FULL_ONE_GROUP, FULL_BLOCK, SELECTIVE],
                         ids=["plain", "full-uniform", "full-one-group", "full-block", "selective"])
def test_one_f_one_b_order_with_recompute_equals_the_plain_steps(setup, plain, settings):
    hf_dir, batches = setup
    _assert_same(plain, _steps(hf_dir, batches, interleaved=True, **settings))


def test_evaluation_forward_adds_the_same_features(setup, plain):
    """``forward_only`` (evaluation: ``model.eval()``, no autograd graph) adds the features too: its
    per-token losses are the training forward's, with full recomputation configured (megatron skips
    it outside training)."""
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.family import modality_inputs_from_batch

    hf_dir, batches = setup
    model, info = build_single_process_model(hf_dir, model_cfg=ModelConfig(hf_model=hf_dir, **FULL_UNIFORM),
                                             config_overrides={"calculate_per_token_loss": True})
    model.eval()
    losses = []
    with torch.no_grad():
        for b in batches:
            out, mask = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=None,
                              loss_mask=b["loss_mask"], labels=b["labels"],
                              modality_inputs=modality_inputs_from_batch(b, info.encoder_name))
            losses.append(out[mask.bool()])
    torch.testing.assert_close(torch.cat(losses), plain[0], rtol=1e-6, atol=0)
