"""train.expert_load's pieces on their own (no processes): the Switch loss against transformers' own,
the aux attachment's gradient against autograd of the written-out objective, the real-token rows."""

from __future__ import annotations

import torch

from mimo_sft.train.expert_load import ExpertLoad, _AttachAux, switch_aux_loss


def test_switch_loss_is_transformers_load_balancing_loss_over_top_k():
    """transformers' ``load_balancing_loss_func`` on one layer sums the top-k slots' shares (k at perfect
    balance); megatron's and ours divide by k (1 at perfect balance)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    torch.manual_seed(0)
    for experts, k in ((8, 2), (16, 4)):
        logits = 2.0 * torch.randn(37, experts)
        ref = load_balancing_loss_func((logits,), experts, k)
        assert torch.allclose(switch_aux_loss(logits, k) * k, ref, rtol=1e-6), (switch_aux_loss(logits, k), ref)
    uniform = torch.zeros(64, 8)
    uniform[torch.arange(64), torch.arange(64) % 8] = 5.0  # every expert first choice of 8 tokens
    assert switch_aux_loss(uniform, 1).item() < 1.0 + 1e-6


def test_attached_loss_adds_weight_times_its_gradient():
    torch.manual_seed(1)
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(10, 6, requires_grad=True)
    m = torch.randn(6, 6)
    out = x @ m
    got_out = _AttachAux.apply(out, switch_aux_loss(x @ w.t(), 2), 0.7)
    assert torch.equal(got_out, out)
    got_out.pow(2).sum().backward()
    got = (w.grad.clone(), x.grad.clone())
    w.grad = x.grad = None
    ((x @ m).pow(2).sum() + 0.7 * switch_aux_loss(x @ w.t(), 2)).backward()
    assert torch.allclose(got[0], w.grad) and torch.allclose(got[1], x.grad)


def test_real_rows_padded_packed_and_sequence_parallel():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # [B=2, S=4], right-padded
    load = ExpertLoad(None, num_layers=1, num_experts=8, topk=2, tp=1, sequence_parallel=False)
    load.see({"attention_mask": mask, "loss_mask": mask})
    # megatron's [S, B] order: s0b0, s0b1, s1b0, s1b1, ...
    assert load._real_rows(8).tolist() == [True, True, True, True, True, False, False, False]
    assert load._real_rows(6).tolist() == [True] * 5 + [False]  # packed: 5 real tokens first, then padding
    sp = [ExpertLoad(None, num_layers=1, num_experts=8, topk=2, tp=2, sequence_parallel=True, tp_rank=r) for r in (0, 1)]
    for s in sp:
        s.see({"attention_mask": mask, "loss_mask": mask})
    assert sp[0]._real_rows(4).tolist() == [True] * 4 and sp[1]._real_rows(4).tolist() == [True, False, False, False]
