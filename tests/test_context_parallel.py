"""Context parallelism's pieces (``model.context_parallel``, ``train.packing.pack_documents``): the per-document
zigzag against megatron's own THD rotary and Gated DeltaNet splits, the packed documents, and the Ulysses
all-to-all attention against the whole sequence's attention in one process (forward and every gradient)."""

import pytest
import torch

from mimo_sft.model.context_parallel import ContextSplit, kv_repeat, zigzag_positions
from mimo_sft.train.packing import pack_documents


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_is_the_split_megatron_rotary_and_gdn_assume(cp):
    """megatron's THD rotary picks each document's chunks r and 2cp-1-r of the whole packed angles
    (``_get_thd_freqs_on_this_cp_rank`` with the document's offset), and its Gated DeltaNet undoes the same split
    after its all-to-all (``_build_thd_cp_a2a_perm``): ours must be both."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
    from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm

    lengths = [4 * cp, 2 * cp, 10 * cp, 2 * cp]
    total = sum(lengths)
    freqs = torch.arange(total)
    per_rank = [zigzag_positions(lengths, cp, r) for r in range(cp)]
    for rank in range(cp):
        start, picked = 0, []
        for n in lengths:
            picked.append(_get_thd_freqs_on_this_cp_rank(rank, cp, torch.zeros(n // cp), freqs, start))
            start += n
        assert torch.equal(torch.cat(picked), per_rank[rank])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    to_natural, _ = _build_thd_cp_a2a_perm(cu, cp, total)
    split = ContextSplit.build(lengths, cp=cp, rank=0, group=None, device="cpu")
    assert torch.equal(to_natural, split.natural) and torch.equal(torch.cat(per_rank)[split.natural], freqs)
    assert sorted(torch.cat(per_rank).tolist()) == list(range(total))  # every position once


def test_kv_repeat_makes_cp_divide_the_kv_heads():
    assert kv_repeat(8, 4, 2) == 1 and kv_repeat(8, 1, 2) == 2 and kv_repeat(28, 4, 7) == 7
    assert kv_repeat(14, 2, 7) == 7 and kv_repeat(12, 3, 4) == 4


def _batch(lengths, s=11):
    b = len(lengths)
    mask = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    ids = torch.arange(b * s).reshape(b, s) + 100
    labels = ids + 1000
    loss = (torch.arange(s)[None] % 2 == 0) & mask
    labels[~loss] = 7  # the pad id: every unsupervised label
    pos = torch.arange(s).expand(3, b, s).clone() * torch.tensor([1, 2, 3])[:, None, None]
    return dict(input_ids=ids, labels=labels, loss_mask=loss.float(), attention_mask=mask, position_ids=pos,
                source_ids=torch.arange(b))


def test_pack_documents_pads_each_document_to_2cp():
    batch = _batch([5, 0, 11, 3])
    out, kwargs, rows = pack_documents(batch, cp=2, multiple=4)
    assert kwargs["cu_seqlens_q"].tolist() == [0, 8, 20, 24, 32]  # 5->8, (empty row dropped), 11->12, 3->4, pad 8
    assert out["input_ids"].shape == (1, 32) and out["position_ids"].shape == (3, 1, 32)
    assert rows[24:].tolist() == [-1] * 8 and out["loss_mask"][0, 24:].sum() == 0
    assert rows[:8].tolist() == [0] * 5 + [-1] * 3 and rows[8:20].tolist() == [2] * 11 + [-1]
    assert out["input_ids"][0, :5].tolist() == batch["input_ids"][0, :5].tolist()
    assert out["input_ids"][0, 5:8].tolist() == [7, 7, 7] and out["loss_mask"][0, 5:8].tolist() == [0, 0, 0]
    assert out["loss_mask"].sum() == batch["loss_mask"].sum()  # every supervised token once, no pad supervised
    # a document's pads continue its positions (they are attended only by themselves: after every real token)
    assert out["position_ids"][:, 0, 5:8].tolist() == [[5, 6, 7], [9, 10, 11], [13, 14, 15]]
    padded, kw, _ = pack_documents(batch, cp=2, keep_padding=True)  # --no-in-batch-packing: whole rows
    assert kw["cu_seqlens_q"].tolist() == [0, 12, 24, 36, 48]
    assert torch.equal(padded["position_ids"][:, 0, :11], batch["position_ids"][:, 0])


def _attention_ranks(rank, world, lengths, heads, groups, d, varlen=False):
    import torch.distributed as dist

    from mimo_sft.model import segments
    from mimo_sft.model.context_parallel import ulysses_attention
    from mimo_sft.model.segments import SegmentBatch

    if varlen:  # the GPU path: torch's variable-length kernel, here its documented contract computed on the CPU
        from test_vision_attention import _reference_varlen

        kernel, _ = _reference_varlen(with_window=True)
        segments.varlen_runs, segments.varlen_function = (lambda q: True), (lambda: kernel)

    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, n, d, generator=gen, dtype=torch.float64) for n in (heads, groups, groups))
    w = torch.randn(total, heads, d, generator=gen, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = SegmentBatch(lengths, torch.device("cpu")).attend(*ref_in, causal=True, scale=0.3)
    (ref * w).sum().backward()
    split = ContextSplit.build(lengths, cp=world, rank=rank, group=dist.group.WORLD, device="cpu")
    mine = [x[split.local_host].clone().requires_grad_() for x in (q, k, v)]
    out = ulysses_attention(*mine, split, SegmentBatch(lengths, torch.device("cpu")), scale=0.3)
    (out.view(-1, heads, d) * w[split.local_host]).sum().backward()
    errors = [(out.view(-1, heads, d) - ref[split.local_host]).abs().max().item()]
    errors += [(m.grad - r.grad[split.local_host]).abs().max().item() for m, r in zip(mine, ref_in)]
    return errors


@pytest.mark.parametrize("world,heads,groups", [(2, 4, 2), (2, 4, 1), (4, 8, 2)])
def test_ulysses_attention_equals_the_whole_sequence(world, heads, groups):
    """Each rank's output and the gradients of its q, k and v positions are the one-process attention's over the
    whole packed sequence (documents of several lengths; GQA, with K/V repeated where cp does not divide them)."""
    from dist_utils import run_distributed

    lengths = [2 * world, 6 * world, 4 * world]
    for errors in run_distributed(_attention_ranks, world, lengths, heads, groups, 8):
        assert max(errors) < 1e-12, errors


def test_ulysses_attention_on_the_variable_length_kernel():
    """On a GPU the exchanged q, k and v (stacked along the heads) go to torch's variable-length kernel in one call
    (``SegmentBatch.attend_stacked``); with the kernel's documented contract standing in for it, the result and the
    gradients are the whole sequence's (GQA by the kernel's flag)."""
    from dist_utils import run_distributed

    for errors in run_distributed(_attention_ranks, 2, [4, 12, 8], 4, 2, 8, True):
        assert max(errors) < 1e-12, errors


def _saved_ranks(rank, world, hf_dir, lengths):
    from mimo_sft.testing.cp_measure import measure

    return measure(hf_dir, lengths, dtype=torch.float32, num_layers=2, timed=False)["saved_bytes"]


def test_saved_bytes_per_rank_at_cp4_are_under_0_3x_cp1(tmp_path):
    """The decoder (2 layers as training builds them) on one packed row of 4 documents: what autograd keeps on
    each of 4 cp ranks is at most 0.3x what one rank keeps for the whole row (the issue's bar; the ideal is 0.25:
    the all-to-all's indexes over the whole row and K/V repeated to 4 heads do not split)."""
    from dist_utils import run_distributed

    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    hf_dir = str(write_tiny_checkpoint(tmp_path / "m", config_only=True, text_hidden=128, heads=4, kv_heads=2))
    lengths = [512, 256, 768, 512]
    whole = run_distributed(_saved_ranks, 1, hf_dir, lengths)[0]
    per_rank = run_distributed(_saved_ranks, 4, hf_dir, lengths)
    assert max(per_rank) <= 0.3 * whole, (per_rank, whole)
    assert min(per_rank) >= 0.2 * whole, (per_rank, whole)  # each rank holds a quarter: nothing went missing


def _audit_ranks(rank, world, flags):
    from mimo_sft.testing.audit_run import audit_training

    return audit_training(flags, 2, world_size=world)


_audit_ranks.on_standin_device = True  # dist_utils: this rank's device is the device audit's stand-in


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_cp2_trains_on_the_stand_in_device_mixing_nothing_and_reading_no_more(tmp_path, family):
    """Two cp ranks on the device audit's stand-in (``testing.device_audit``): the split's indexes, the all-to-alls,
    the encoder rows' gradient sum and (Qwen3.5) GDN's permutation mix no host tensor into device work, and a step
    reads back no more than a run without cp (the grad norm's list; the losses at the log step)."""
    from dist_utils import run_distributed
    from test_device_audit import STEPS, _within_budget

    from mimo_sft.testing.clips import write_video_dataset
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    data = str(write_video_dataset(tmp_path / "video", samples=4, seed=3).parent)
    model = str(write_tiny_checkpoint(tmp_path / family, seed=0, family=family))
    flags = ["--hf-model", model, "--dataset-path", data, "--output-dir", str(tmp_path / "run"),
             "--component", "language=cp=2,dp=1", "--component", "images=dp=2", "--seq-length", "256",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(STEPS + 1), "--no-save",
             "--no-tensorboard", "--dataloader-type", "cyclic", "--num-workers", "0", "--lr", "1e-3",
             "--lr-warmup-iters", "0", "--seed", "5", "--log-interval", "2"]
    reports = run_distributed(_audit_ranks, 2, flags, timeout=600)
    for report in reports:
        for part in [report["setup"], *report["steps"], *report["logs"]]:
            assert not part["mixed"], part["mixed"]
        for step, (stepped, logged) in enumerate(zip(report["steps"], report["logs"]), start=1):
            over = _within_budget(family, step, stepped["reads"], logged["reads"])
            assert not over, (step, over)
    # each rank's loss over its own positions (a rank whose chunks hold no answer token has none): it trained
    for losses in zip(*(r["losses"] for r in reports)):
        assert max(losses) > 0 and all(0 <= loss < 20 for loss in losses), losses
