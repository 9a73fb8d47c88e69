"""Qwen3.5 under language tensor parallelism (2 gloo ranks): the Gated DeltaNet output norm's gradient.

Each TP rank normalises only its own value heads, so the replicated norm weight gets a partial
gradient on each rank, with or without sequence parallelism; megatron's finalize does not reduce it
(it sums norms over TP only under sequence parallelism, and q/k norms by name).
``train.step.sum_partial_grads_over_tp`` sums it. Checked against the single-process model's gradient
(fp32, 1e-5 of the tensor's largest entry): equal after the sum; before it, each rank's gradient is
off and the two ranks' differ -- the replicated weights would drift apart without the sum.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint
    from transformers import Qwen3_5ForConditionalGeneration

    out = write_tiny_checkpoint(tmp_path_factory.mktemp("q35tp") / "m", family="qwen3_5", text_layers=4,
                                tie_embeddings=False)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p) if "norm" in name else 0.03 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return str(out)


def _batch(hf_dir: str) -> dict:
    from transformers import AutoConfig

    from mimo_sft.model.check import random_batch

    return random_batch(AutoConfig.from_pretrained(hf_dir), seed=3, image_grids=[], text_only=2, text_len=90)


def _loss(model, batch):
    b, n = batch["input_ids"].shape
    pos = torch.arange(n).expand(3, b, n)  # text only: the three mRoPE rows are the token index
    per_token, _ = model(input_ids=batch["input_ids"], position_ids=pos, attention_mask=None,
                         loss_mask=batch["loss_mask"], labels=batch["labels"], modality_inputs=None)
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def _norm_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.language_model.named_parameters() if "out_norm" in n}


def _tp2_worker(rank: int, world: int, hf_dir: str, sequence_parallel: bool):
    from mimo_sft.config.schema import ModelConfig
    from mimo_sft.model.builder import build_mimo_model
    from mimo_sft.parallel import runtime
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.parallel.layout import Layout
    from mimo_sft.train.setup import megatron_ranks
    from mimo_sft.train.step import sum_partial_grads_over_tp

    layout = Layout.from_specs([parse_component("language=tp=2,dp=1"), parse_component("images=tp=2,dp=1")])
    state = build_parallel_state(layout)
    runtime.init_megatron(0, **megatron_ranks(state))
    model, _info = build_mimo_model(hf_dir, layout=layout, parallel_state=state,
                                    model_cfg=ModelConfig(sequence_parallel=sequence_parallel))
    batch = _batch(hf_dir)
    _loss(model, batch).backward()
    before = _norm_grads(model)
    sum_partial_grads_over_tp(model, state.modules["language"].pg_collection.tp)
    return before, _norm_grads(model)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
def test_gdn_output_norm_gradient_is_summed_over_tp(q35_dir, sequence_parallel):
    from mimo_sft.model.builder import build_single_process_model

    ref_model, _ = build_single_process_model(q35_dir)
    _loss(ref_model, _batch(q35_dir)).backward()
    ref = _norm_grads(ref_model)
    assert len(ref) == 3  # one per GDN layer
    results = run_distributed(_tp2_worker, 2, q35_dir, sequence_parallel, timeout=300)
    for name, want in ref.items():
        scale = want.abs().max()
        for before, after in results:
            assert (after[name] - want).abs().max() <= TOL * scale, name
            assert (before[name] - want).abs().max() > 1e-2 * scale, name  # a rank's part alone is far off
        assert (results[0][0][name] - results[1][0][name]).abs().max() > 1e-2 * scale, name
