"""train/bridge.py without processes: the pad/strip index arithmetic, a simulated fan-in and fan-out
(megatron's even split and all-gather done with plain tensors) that must hand every language rank
exactly its samples' encoder rows with exact gradients, the claim that every rank of megatron's
gather groups reads one shard, the split's bridge fields, and the encoder's zero-image output."""

import itertools

import pytest
import torch

from reorder_helpers import IMAGE_TOKEN_ID, encoder_slice_pixels, make_batch

from mimo_sft.data.reorder.serialize import merge_samples
from mimo_sft.data.colocated import ColocatedSplit, bridge_pads, colocated_read_plan, image_tokens_per_sample
from mimo_sft.model.family import modality_inputs_from_batch
from mimo_sft.parallel.components import parse_component
from mimo_sft.parallel.layout import Layout
from mimo_sft.train.bridge import (PaddedBridge, block_rows, bridge_plan, check_gather_groups_read_one_shard,
                                   pad_blocks, strip_blocks)


def test_block_rows():
    assert block_rows([2, 0, 3], 3).tolist() == [0, 1, 6, 7, 8]
    assert block_rows([], 5).tolist() == []
    assert block_rows([0, 0], 0).tolist() == []
    assert block_rows([4], 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        block_rows([1, 4], 3)


def test_pad_then_strip_is_the_identity_with_exact_gradients():
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), 6, requires_grad=True)
    plan = bridge_plan(counts, counts, 5)
    padded = pad_blocks(x, plan)
    assert padded.shape == (4 * 5, 6)
    assert torch.equal(padded[5:10], torch.zeros(5, 6)) and torch.equal(padded[10:15], x[3:8])
    y = strip_blocks(padded, plan)
    assert torch.equal(y, x)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


def _simulate(counts, width_dp_enc, dp_lang):
    """Every rank of one bridge: encoder DP ``width_dp_enc`` slices pad, megatron's bridge moves the
    padded tensors (fan-in: concatenation of sibling slices; fan-out: even narrow of one slice; its
    backward: the adjoint), language DP ``dp_lang`` slices strip. Returns per-language-rank outputs,
    the gradients of the per-encoder-rank inputs, and the unpadded reference."""
    n = len(counts)
    L = max(counts)
    h = 3
    full = torch.randn(sum(counts), h, dtype=torch.float64)
    offsets = [0] + list(itertools.accumulate(counts))
    n_enc, n_lang = n // width_dp_enc, n // dp_lang
    enc_inputs = [full[offsets[d * n_enc]: offsets[(d + 1) * n_enc]].clone().requires_grad_(True)
                  for d in range(width_dp_enc)]
    padded = [pad_blocks(x, bridge_plan(counts[d * n_enc:(d + 1) * n_enc], [], L)) for d, x in enumerate(enc_inputs)]
    if width_dp_enc >= dp_lang:  # fan-in (or equal): language rank l gathers its encoder siblings
        scale = width_dp_enc // dp_lang
        moved = [torch.cat(padded[l * scale:(l + 1) * scale]) for l in range(dp_lang)]
    else:  # fan-out: language rank l narrows its slot of the encoder slice
        scale = dp_lang // width_dp_enc
        moved = []
        for l in range(dp_lang):
            src = padded[l // scale]
            size = src.shape[0] // scale
            moved.append(src.narrow(0, (l % scale) * size, size))
    outs = [strip_blocks(m, bridge_plan([], counts[l * n_lang:(l + 1) * n_lang], L)) for l, m in enumerate(moved)]
    weights = [torch.randn_like(o) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    want_out = [full[offsets[l * n_lang]: offsets[(l + 1) * n_lang]] for l in range(dp_lang)]
    want_grad = torch.cat(weights) if weights else torch.zeros(0, h)
    grads = torch.cat([x.grad if x.grad is not None else torch.zeros_like(x) for x in enc_inputs])
    return outs, want_out, grads, want_grad


@pytest.mark.parametrize("dp_enc,dp_lang", [(2, 1), (4, 1), (4, 2), (1, 2), (1, 4), (2, 4)])
@pytest.mark.parametrize("counts", [[3, 0, 7, 1], [0, 0, 0, 5], [2, 2, 2, 2], [9, 0, 0, 0]])
def test_simulated_fan_in_and_fan_out_move_exactly_each_sample(dp_enc, dp_lang, counts):
    outs, want, grads, want_grad = _simulate(counts, dp_enc, dp_lang)
    for got, exp in zip(outs, want):
        assert torch.equal(got, exp)
    assert torch.equal(grads, want_grad)


def _gather_groups(layout):
    """megatron's own gather groups for ``layout`` (its __init__ without the process groups)."""
    from mimo_sft.parallel import runtime  # noqa: F401  (makes megatron importable)
    from megatron.core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator
    from mimo_sft.parallel.groups import build_grid

    comm = object.__new__(ColocatedBridgeCommunicator)
    comm.src_grid, comm.dest_grid = build_grid(layout.encoders[0]), build_grid(layout.language)
    comm._extract_parallelism_info()
    comm._build_rank_mappings()
    if comm.src_dp_size > comm.dest_dp_size:
        scale = comm.src_dp_size // comm.dest_dp_size
        return ColocatedBridgeCommunicator._build_gather_groups(comm.dest_dp_size, comm.src_tp_size, scale,
                                                                comm.rank_to_src_pos)
    scale = comm.dest_dp_size // comm.src_dp_size
    return ColocatedBridgeCommunicator._build_gather_groups(comm.src_dp_size, comm.dest_tp_size, scale,
                                                            comm.rank_to_dest_pos)


def _colocated_layouts(max_world=16):
    for world in (2, 4, 8, 16):
        if world > max_world:
            continue
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        for ltp, etp in itertools.product(divisors, divisors):
            ldp, edp = world // ltp, world // etp
            if ldp == edp:
                continue
            yield [f"language=tp={ltp},dp={ldp}", f"images=tp={etp},dp={edp}"], world


@pytest.mark.parametrize("components,world", list(_colocated_layouts()),
                         ids=[" ".join(c) for c, _ in _colocated_layouts()])
def test_every_gather_group_reads_one_shard(components, world, monkeypatch):
    """The padded bridge computes L from the read shard with no collective: true when every rank of
    each of megatron's gather groups reads the same shard (fan-in: the language shard; fan-out: the
    encoder shard), and the group's slices tile that shard."""
    from mimo_sft.parallel import runtime

    monkeypatch.setenv("WORLD_SIZE", str(world))  # HyperCommGrid reads it; no process group needed
    monkeypatch.setattr(runtime, "backend", lambda: "gloo")  # no device chosen in this process
    layout = Layout.from_specs([parse_component(c) for c in components], world)
    assert bridge_pads(layout)
    mbs = 2 * world
    groups = _gather_groups(layout)
    check_gather_groups_read_one_shard(groups, layout, mbs)
    for group in groups:
        plans = [colocated_read_plan(layout, r, mbs) for r in group]
        fan_in = layout.encoders[0].dp > layout.language.dp
        slices = [p.encoder if fan_in else p.language for p in plans]
        covered = [i for s in slices for i in range(s.start, s.stop)]
        assert covered == list(range(mbs // plans[0].dp_size)), (group, slices)  # in group order


def test_a_group_reading_two_shards_is_refused():
    layout = Layout.from_specs([parse_component("language=dp=2"), parse_component("images=tp=2,dp=1")], 2)
    check_gather_groups_read_one_shard([[0, 1]], layout, 4)
    lay4 = Layout.from_specs([parse_component("language=tp=2,dp=2"), parse_component("images=dp=4")], 4)
    with pytest.raises(AssertionError, match="reads different shards"):
        check_gather_groups_read_one_shard([[0, 2]], lay4, 4)


def test_split_hands_over_the_bridge_counts():
    """Fan-in (language tp 2 dp 1, images dp 2): rank 1 keeps the whole micro-batch's language
    fields, the pixels of samples 2-3, their token counts and L of the whole shard."""
    layout = Layout.from_specs([parse_component("language=tp=2,dp=1"), parse_component("images=dp=2")], 2)
    batch = make_batch(range(4), with_pixels=True)
    tokens = image_tokens_per_sample(batch, IMAGE_TOKEN_ID)
    plan = colocated_read_plan(layout, 1, 4)
    out = ColocatedSplit.for_plan(plan, layout, image_token_id=IMAGE_TOKEN_ID)(encoder_slice_pixels(batch, plan.encoder))
    assert torch.equal(out["input_ids"], batch["input_ids"])
    assert torch.equal(out["encoder_image_tokens"], tokens[2:4])
    assert out["bridge_tokens_per_sample"] == int(tokens.max())
    equal = Layout.from_specs([parse_component("language=dp=2"), parse_component("images=dp=2")], 2)
    eq_plan = colocated_read_plan(equal, 1, 4)
    plain = ColocatedSplit.for_plan(eq_plan, equal, image_token_id=IMAGE_TOKEN_ID)(
        encoder_slice_pixels(make_batch(range(2, 4), with_pixels=True), eq_plan.encoder))
    assert "encoder_image_tokens" not in plain and "bridge_tokens_per_sample" not in plain


def test_text_only_encoder_slice_still_runs_the_encoder_when_the_shard_has_images():
    layout = Layout.from_specs([parse_component("language=tp=2,dp=1"), parse_component("images=dp=2")], 2)
    batch = merge_samples([make_batch([i], with_pixels=True, text_only=i >= 2) for i in range(4)])
    assert int(image_tokens_per_sample(batch, IMAGE_TOKEN_ID)[:2].max()) > 0
    plan = colocated_read_plan(layout, 1, 4)
    out = ColocatedSplit.for_plan(plan, layout, image_token_id=IMAGE_TOKEN_ID)(encoder_slice_pixels(batch, plan.encoder))
    assert out["pixel_values"].shape[0] == 0 and out["encoder_image_tokens"].tolist() == [0, 0]
    inputs = modality_inputs_from_batch(out)
    assert inputs is not None and inputs["images"]["qwen_vit"]["image_grid_thw"].shape == (0, 3)
    # a shard with no image at all: no rank of the group runs the encoder
    text = merge_samples([make_batch([i], with_pixels=True, text_only=True) for i in range(4)])
    out = ColocatedSplit.for_plan(plan, layout, image_token_id=IMAGE_TOKEN_ID)(encoder_slice_pixels(text, plan.encoder))
    assert out["bridge_tokens_per_sample"] == 0 and modality_inputs_from_batch(out) is None


class _Identity:
    """A stand-in communicator (EQUAL-like) that records what it was given."""

    direction = "fake"

    def __init__(self):
        self.seen = []
        self.destroyed = False

    def communicate(self, t):
        self.seen.append(t.shape)
        return t

    def destroy(self):
        self.destroyed = True


def test_padded_bridge_prepares_pads_strips_and_delegates():
    batch = merge_samples([make_batch([i], with_pixels=True, text_only=i == 1) for i in range(3)])
    tokens = image_tokens_per_sample(batch, IMAGE_TOKEN_ID)
    batch["encoder_image_tokens"] = tokens
    batch["bridge_tokens_per_sample"] = int(tokens.max()) + 2
    comm = _Identity()
    bridge = PaddedBridge(comm, image_token_id=IMAGE_TOKEN_ID)
    assert bridge.direction == "fake"
    x = torch.randn(int(tokens.sum()), 4)
    bridge.prepare(batch)
    assert torch.equal(bridge.communicate(x), x)
    assert comm.seen == [torch.Size([3 * (int(tokens.max()) + 2), 4])]
    with pytest.raises(RuntimeError, match="without prepare"):
        bridge.communicate(x)  # one prepare per micro-batch
    with pytest.raises(RuntimeError, match="encoder_image_tokens"):
        bridge.prepare({"input_ids": batch["input_ids"]})
    bridge.destroy()
    assert comm.destroyed


def test_encoder_with_zero_images_gives_connected_empty_output():
    from transformers import Qwen2_5_VLConfig

    from mimo_sft.model.qwen2_5_vl import Qwen25VisionEncoder

    cfg = Qwen2_5_VLConfig(vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                                              out_hidden_size=20, fullatt_block_indexes=[0])).vision_config
    enc = Qwen25VisionEncoder(cfg)
    pix = torch.zeros(0, 3 * cfg.temporal_patch_size * cfg.patch_size ** 2)
    out = enc(pix, torch.zeros(0, 3, dtype=torch.int64))
    assert out.shape == (0, 20) and out.requires_grad
    out.sum().backward()
    grads = [p.grad for p in enc.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    for p in enc.parameters():
        p.requires_grad_(False)
    assert not enc(pix, torch.zeros(0, 3, dtype=torch.int64)).requires_grad
