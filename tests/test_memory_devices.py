"""The forecast's device branch: torch's RMSNorm keeps less on CUDA (one fused kernel) than on the CPU.

* each branch against the bytes autograd saves in a real-width decoder layer (Qwen2.5-VL-7B, bf16; a
  tiny one in fp32): ``device="cpu"`` on the CPU's own path, ``device="cuda"`` on CUDA's dispatch path
  (``testing.saved_bytes.cuda_rms_norm_saved_tensors``: torch's own autograd node of the fused kernel
  records what it keeps; no CUDA kernel runs here, so this is derived from torch, not measured on a GPU);
* the forecast follows its ``device``: only the language norms move (the vision tower and Qwen3.5's own
  norms keep the same on both), and check 23 picks CUDA unless a run starts here on the CPU;
* Qwen2.5-VL-7B at language tp 2, 8k tokens, no recomputation: the language peak against the hand count
  of docs/memory.md.
"""

from __future__ import annotations

import pytest
import torch

from mimo_sft.config.checks.context import read_hf_config
from mimo_sft.config.loader import load_config
from mimo_sft.memory import activations as act
from mimo_sft.memory.dims import TextDims
from mimo_sft.memory.forecast import GIB, forecast_memory
from mimo_sft.validate import check_config

TOKENS = 128


@pytest.fixture(scope="module")
def q7b(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import preset_config

    out = tmp_path_factory.mktemp("q7b_dev")
    preset_config("qwen2.5-vl-7b").save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_dev"), text_layers=1))


def _measured(hf_dir, dtype, device):
    from mimo_sft.testing import saved_bytes as sb

    block, cfg = sb.language_layer(hf_dir, dtype=dtype)
    return sb.language_layer_saved(block, cfg, TOKENS, dtype=dtype, device=device)


@pytest.mark.parametrize("device", act.DEVICES)
@pytest.mark.parametrize("case", ["7b bf16", "tiny fp32"])
def test_decoder_layer_bytes_per_device(q7b, tiny, case, device):
    hf_dir, dtype, b = (q7b, torch.bfloat16, 2) if case == "7b bf16" else (tiny, torch.float32, 4)
    d = TextDims.from_config(read_hf_config(hf_dir))
    terms = act.language_layer_terms(d, tp=1, sp=False, b=b, device=device)
    measured = _measured(hf_dir, dtype, device)
    assert measured == round(sum(terms.values()) * TOKENS), (measured / TOKENS, terms)
    # the two norms: the fused kernel keeps the input and rstd, the composite fp32 copies of input and output
    expected = 2 * ((b * d.hidden + 4) if device == "cuda" else (8 * d.hidden + 4))
    assert terms["norms"] == expected


def test_the_cuda_path_keeps_the_norm_inputs_where_the_cpu_keeps_fp32_copies(q7b):
    """Per token, the two norms of a layer keep ``2 x (8 - b) h`` bytes fewer on CUDA: 12 h in bf16."""
    d = TextDims.from_config(read_hf_config(q7b))
    cpu, cuda = (_measured(q7b, torch.bfloat16, device) for device in ("cpu", "cuda"))
    assert cpu - cuda == 12 * d.hidden * TOKENS


def _layout(hf_dir, *extra):
    cfg = load_config(["--component", "language=tp=2,dp=4", "--component", "images=dp=4,rank_offset=8",
                       "--hf-model", hf_dir, "--allow-random-init", "--dtype", "bf16", "--seq-length", "8192",
                       "--micro-batch-size", "4", "--global-batch-size", "16", "--use-distributed-optimizer",
                       "--gpu-memory-gb", "80", *extra])
    return cfg, check_config(cfg)


def test_the_forecast_follows_its_device(q7b, tmp_path):
    cfg, result = _layout(q7b)
    hf = read_hf_config(q7b)
    cuda, cpu = (forecast_memory(cfg, result.layout, hf, device=dev) for dev in ("cuda", "cpu"))
    d = TextDims.from_config(hf)
    lang_cuda, lang_cpu = cuda.modules["language"].terms, cpu.modules["language"].terms
    tokens = 8192  # one sample per language rank
    per_token = 2 * (8 - 2) * d.hidden  # the two norms of each layer, bf16, no sequence parallelism
    assert lang_cpu["activations"] - lang_cuda["activations"] == pytest.approx(d.layers * tokens * per_token, abs=2)
    assert lang_cpu["logits"] - lang_cuda["logits"] == pytest.approx(tokens * (8 - 2) * d.hidden, abs=2)
    assert cuda.modules["images"].terms == cpu.modules["images"].terms
    assert (cuda.device, cpu.device) == ("cuda", "cpu") and cuda.report(1, "x")["device"] == "cuda"
    with pytest.raises(ValueError, match="device"):
        forecast_memory(cfg, result.layout, hf, device="tpu")


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_qwen3_5_norms_keep_their_fp32_copy_and_rstd_on_cuda(tmp_path, kind):
    """Qwen3.5's zero-centred norms are one ``F.rms_norm`` over an fp32 copy: on CUDA's path the fused op keeps
    that copy and rstd (``4w + 4`` per row), on the CPU the composite also the normalised rows (``8w + 4``).
    The formula per device, and one 0.8B layer measured on CUDA's dispatch path: equal, less only the
    per-layer fp32 ``1 + w`` tables."""
    from mimo_sft.testing import saved_bytes as sb
    from mimo_sft.testing.tiny_checkpoint import preset_config

    preset_config("qwen3.5-0.8b").save_pretrained(str(tmp_path))
    d = TextDims.from_config(read_hf_config(str(tmp_path)))
    assert d.layer_types and not d.torch_norm
    cuda, cpu = (act.language_layer_terms(d, tp=1, sp=False, b=2, layer_type=kind, device=dev)
                 for dev in ("cuda", "cpu"))
    qk = (d.heads + d.kv_heads) * 4 * d.head_dim if kind == "full_attention" else 0
    assert cpu["norms"] - cuda["norms"] == 2 * 4 * d.hidden and cpu.get("qk norm", 0) - cuda.get("qk norm", 0) == qk
    assert {k: v for k, v in cuda.items() if "norm" not in k} == {k: v for k, v in cpu.items() if "norm" not in k}
    head = [act.language_head_terms(d, tp=1, sp=False, b=2, device=dev)["final norm"] for dev in ("cpu", "cuda")]
    assert head[0] - head[1] == 4 * d.hidden
    block, cfg = sb.language_layer(str(tmp_path), dtype=torch.bfloat16, layer_type=kind)
    tables = 4 * (2 * d.hidden + (2 * d.head_dim if kind == "full_attention" else 0))
    tokens = 128
    assert sb.language_layer_saved(block, cfg, tokens, dtype=torch.bfloat16, device="cuda") == \
        round(sum(cuda.values()) * tokens) + tables


def test_check_23_forecasts_cuda_unless_a_run_starts_here_on_the_cpu(q7b, monkeypatch):
    from mimo_sft.memory import gpu

    assert check_config(load_config(["--component", "language=dp=1", "--component", "images=dp=1,rank_offset=1",
                                     "--hf-model", q7b, "--allow-random-init", "--gpu-memory-gb", "1000"])
                        ).memory["device"] == "cuda"  # validate: what the cluster runs
    monkeypatch.setattr(gpu, "local_gpu_bytes", lambda: None)
    assert gpu.forecast_device(for_run=True, planning=False) == "cpu"  # finetune here, on the CPU
    assert gpu.forecast_device(for_run=True, planning=True) == "cuda"  # plan: the cluster's run
    assert gpu.forecast_device(for_run=False, planning=False) == "cuda"
    monkeypatch.setattr(gpu, "local_gpu_bytes", lambda: 80 * GIB)
    assert gpu.forecast_device(for_run=True, planning=False) == "cuda"  # finetune here, on this GPU


def hand_count_7b_tp2_8k() -> dict[str, float]:
    """docs/memory.md's hand count, term by term, in GiB: Qwen2.5-VL-7B, language tp 2 x dp 4, one 8192-token
    sample per rank, bf16, distributed optimizer, no recomputation, no SP, CUDA kernels, fused SwiGLU."""
    h, ffn, layers, heads, kv, hd, vocab = 3584, 18944, 28, 28, 4, 128, 152064
    tp, dp, b, tokens = 2, 4, 2, 8192
    layer = 2 * h + (heads + 2 * kv) * hd // tp * (h + 1) + h * heads * hd // tp + 3 * h * ffn // tp
    params = layers * layer + 2 * vocab // tp * h + h  # layers, embedding and output layer (untied), final norm
    per_layer_token = (2 * (b * h + 4)  # two fused RMSNorms: input + fp32 rstd
                       + 2 * b * h  # linear_qkv's and linear_fc1's inputs (the norms' outputs)
                       + b * (heads + 2 * kv) * hd // tp + b * (heads + kv) * hd // tp  # fused qkv out, rotated q, k
                       + 4 * b * hd  # rotary cos/sin for q and k
                       + 4 * heads // tp + b * heads * hd // tp  # flash attention's log-sum-exp and output
                       + 3 * b * ffn // tp)  # fc1 output (fused SwiGLU's input) and fc2's input
    count = {"weights": b * params, "gradients": 4 * params, "optimizer": 12 * params / dp,
             "activations": layers * tokens * per_layer_token,
             "logits": tokens * ((b * h + 4) + b * h + (4 + b) * vocab // tp),  # final norm, its output, softmax
             "bridge": 2 * tokens * h * b}  # the image embeddings, kept in flight + 1 = 2 copies
    count["allowance"] = 2 * GIB + 0.1 * (count["activations"] + count["logits"])
    return {k: v / GIB for k, v in count.items()}


def test_7b_tp2_8k_language_peak_within_10_percent_of_the_hand_count(q7b):
    hand = hand_count_7b_tp2_8k()
    _, result = _layout(q7b)
    lang = result.memory["modules"]["language"]
    forecast = lang["peak_bytes"] / GIB
    assert abs(forecast - sum(hand.values())) <= 0.10 * sum(hand.values()), (forecast, hand)
    for term, gib in hand.items():  # term by term as docs/memory.md states them
        assert abs(lang["terms"][term] / GIB - gib) <= 0.01 * max(gib, 1), (term, lang["terms"][term] / GIB, gib)
    if act.FUSED_SWIGLU:
        assert forecast < 64 and result.memory["gpu_peaks"]["language"] == lang["peak_bytes"]
