"""DeepStack's language side without processes: the wide encoder rows are split by an asserted width, and
the features land where transformers puts them in every sequence-parallel share (values and gradients)."""

import pytest
import torch

from mimo_sft.model.deepstack import add_deepstack, deepstack_inputs, split_deepstack

H, K, IMAGE = 8, 3, 7


def test_split_takes_main_first_then_each_deepstack_feature():
    wide = torch.randn(5, H * (1 + K))
    main, features = split_deepstack(wide, hidden=H, num_deepstack=K)
    assert torch.equal(main, wide[:, :H]) and torch.equal(features, wide[:, H:])


@pytest.mark.parametrize("shape", [(5, H), (5, H * K), (5, H * (1 + K) + 1), (5, 2, H * (1 + K))])
def test_a_tensor_of_the_wrong_width_is_refused(shape):
    """megatron's alignment checks only the row count: a main-only [n, H] tensor (or any other width)
    would scatter the wrong values; the split refuses it."""
    with pytest.raises(AssertionError, match=rf"expected \[rows, {H * (1 + K)}\]"):
        split_deepstack(torch.zeros(shape), hidden=H, num_deepstack=K)


def test_megatrons_empty_text_only_payload_is_accepted():
    for width in (H, H * (1 + K)):
        main, features = split_deepstack(torch.zeros(0, width), hidden=H, num_deepstack=K)
        assert main.shape == (0, H) and features.shape == (0, H * K)


def _hf_reference(hidden, mask, feature):
    """transformers' Qwen3VLTextModel._deepstack_process on batch-first states: h[mask] = h[mask] + f."""
    h = hidden.transpose(0, 1).clone()
    h[mask] = h[mask] + feature
    return h.transpose(0, 1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_sequence_share_adds_its_rows_and_the_gradients_sum_to_the_full_one(tp):
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 5, (3, 16), generator=g)
    input_ids[0, 2:6] = IMAGE
    input_ids[2, 7:13] = IMAGE  # crosses the share boundaries at tp 2 and 4
    n = int((input_ids == IMAGE).sum())
    hidden = torch.randn(16, 3, H, generator=g)  # [S, B, H]
    features = torch.randn(n, H * K, generator=g, requires_grad=True)
    weight = torch.randn(16, 3, H, generator=g)
    mask = input_ids == IMAGE
    for j in range(K):
        expected = _hf_reference(hidden, mask, features.detach()[:, j * H:(j + 1) * H])
        local = 16 // tp
        outs, grad = [], torch.zeros_like(features)
        for rank in range(tp):
            inputs = deepstack_inputs(input_ids, IMAGE, features, hidden=H, shard=(rank, tp))
            out = add_deepstack(hidden[rank * local:(rank + 1) * local], inputs, j)
            (out * weight[rank * local:(rank + 1) * local]).sum().backward()
            grad += inputs.features.grad  # what the all-reduce over TP sums
            outs.append(out.detach())
        assert torch.equal(torch.cat(outs), expected)
        full = torch.zeros_like(features)
        full[:, j * H:(j + 1) * H] = weight.transpose(0, 1)[mask]  # d(sum w*out)/d(feature_j) at each row
        assert torch.equal(grad, full)
