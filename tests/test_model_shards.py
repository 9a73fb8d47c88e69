"""Pure weight-layout tests (no processes): TP/PP shards reassemble to the TP=1 state, QKV grouping,
and the CPU shims are idempotent and redirect CUDA allocations."""

from __future__ import annotations

import pytest
import torch

from model_helpers import make_tiny_hf


def _merge(shards: list[dict], key: str, groups: int, kind: str) -> torch.Tensor:
    """Reassemble one megatron tensor from its TP shards (the inverse of each split rule)."""
    from mimo_sft.model.decoder_weights import fuse_qkv, split_qkv

    if kind == "rows":
        return torch.cat([s[key] for s in shards], dim=0)
    if kind == "cols":
        return torch.cat([s[key] for s in shards], dim=1)
    if kind == "fc1":
        gates, ups = zip(*[torch.chunk(s[key], 2, dim=0) for s in shards])
        return torch.cat(list(gates) + list(ups), dim=0)
    if kind == "qkv":
        qs, ks, vs = [], [], []
        for s in shards:
            t = s[key]
            g = groups // len(shards)
            hd = 16
            q, k, v = split_qkv(t, g, hd, (t.shape[0] // (g * hd)) - 2)
            qs.append(q), ks.append(k), vs.append(v)
        return fuse_qkv(torch.cat(qs), torch.cat(ks), torch.cat(vs), groups)
    return shards[0][key]


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (1, 2), (4, 1)])
def test_tp_pp_shards_reassemble(tmp_path, tp, pp):
    from mimo_sft.model.decoder_weights import pad_vocab
    from mimo_sft.model.hf_checkpoint import HFCheckpoint
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter

    hf = make_tiny_hf(str(tmp_path / "m"), heads=8, kv_heads=4, hidden=128, layers=4, vocab=158, tie=False)
    ad = Qwen25VLAdapter()
    cfg = ad.load_hf_config(hf, {})
    ck = HFCheckpoint(hf)
    full = _merged(ad.load_language(ck, cfg, tp_rank=0, tp=1, layer_offset=0, num_local_layers=4, pre_process=True,
                            post_process=True, padded_vocab=158))
    padded = pad_vocab(158, tp)
    per = 4 // pp
    for stage in range(pp):
        shards = [_merged(ad.load_language(ck, cfg, tp_rank=r, tp=tp, layer_offset=stage * per, num_local_layers=per,
                                           pre_process=stage == 0, post_process=stage == pp - 1, padded_vocab=padded))
                  for r in range(tp)]
        for key in shards[0]:
            kind = ("qkv" if "linear_qkv" in key else "fc1" if "linear_fc1" in key else
                    "cols" if ("linear_proj" in key or "linear_fc2" in key) else
                    "rows" if ("word_embeddings" in key or "output_layer" in key) else "rep")
            merged = _merge(shards, key, 4, kind)
            if kind == "rows":
                assert torch.all(merged[158:] == 0)
                merged = merged[:158]
            ref_key = key
            if key.startswith("decoder.layers."):
                j = int(key.split(".")[2])
                ref_key = key.replace(f"decoder.layers.{j}.", f"decoder.layers.{stage * per + j}.", 1)
            assert torch.equal(merged, full[ref_key]), (tp, pp, stage, key)
        assert ("embedding.word_embeddings.weight" in shards[0]) == (stage == 0)
        assert ("output_layer.weight" in shards[0]) == (stage == pp - 1)


def _merged(groups) -> dict:
    """The language weights a rank loads, streamed one layer at a time, as one dict."""
    out = {}
    for group in groups:
        assert not set(group) & set(out)
        out.update(group)
    return out


def test_qkv_grouping_is_per_kv_head():
    from mimo_sft.model.decoder_weights import fuse_qkv, split_qkv

    hd, groups, hpg = 2, 2, 2
    q = torch.arange(groups * hpg * hd).float()[:, None] + 100
    k = torch.arange(groups * hd).float()[:, None] + 200
    v = torch.arange(groups * hd).float()[:, None] + 300
    fused = fuse_qkv(q, k, v, groups)
    # group 0: q heads 0,1 (rows 100..103), k head 0 (200,201), v head 0 (300,301); then group 1
    assert fused[:, 0].tolist() == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    q2, k2, v2 = split_qkv(fused, groups, hd, hpg)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_cpu_shims_idempotent_and_redirect():
    from mimo_sft.parallel.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    apply_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.models.mimo import optimizer as mimo_opt
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.utils import get_default_causal_mask

    assert get_default_causal_mask(4).device.type == "cpu"
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert mimo_opt.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(1).type() == "torch.FloatTensor"  # the type-name shim is scoped, not global
    # the shims replace calls, they initialise nothing: that is runtime.init_megatron's job
    assert mrandom._get_cuda_rng_state().dtype == torch.uint8
    del parallel_state


def test_init_megatron_sets_up_what_gpu_layers_use_without_global_groups():
    """The set-up a GPU run executes, run here: memory buffer and the real (training) RNG tracker,
    seeded from explicit ranks -- megatron's global tensor-parallel group is never created, so a
    call that falls back to it (defect: tp_rank omitted) fails here as on a GPU."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from mimo_sft.parallel import runtime

    if not runtime.device_chosen():
        runtime.use_device(runtime.select_device("cpu"))
    assert not parallel_state.model_parallel_is_initialized()
    draws = {}
    for tp_rank in (0, 1, 0):
        runtime.init_megatron(11, tp_rank=tp_rank, ep_rank=0, etp_rank=tp_rank)
        tracker = mrandom.get_cuda_rng_tracker()
        assert not tracker.is_inference_rng_tracker
        assert set(tracker.get_states()) >= {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
        outside = torch.rand(3)
        with tracker.fork():  # what dropout inside tensor-parallel regions does
            inside = torch.rand(3)
        # the forked stream is separate: the default stream continues as if fork never happened
        runtime.seed_everything(11)
        assert torch.equal(torch.rand(3), outside)
        draws.setdefault(tp_rank, []).append(inside)
    assert torch.equal(draws[0][0], draws[0][1])  # same seed and rank, same stream
    assert not torch.equal(draws[0][0], draws[1][0])  # another tp rank draws differently
    buf = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "test")
    assert buf.shape == (2, 3) and buf.device.type == "cpu"
