"""The tiny Qwen2.5-VL checkpoint loads with transformers' Auto classes and runs a forward."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parents[1]

# The chat template shipped with Qwen2-VL / Qwen2.5-VL Instruct checkpoints (no generation markers).
UPSTREAM_QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or "
    "'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def _image(h=100, w=150, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def _messages(img):
    return [
        {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What colour is shown?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The colour is red."}]},
    ]


def test_auto_processor_returns_image_only_processor(tiny_ckpt):
    from transformers import AutoProcessor

    from mimo_sft.data.processor import QwenVLImageOnlyProcessor

    proc = AutoProcessor.from_pretrained(tiny_ckpt)
    assert type(proc) is QwenVLImageOnlyProcessor
    assert not hasattr(proc, "video_processor")
    assert type(proc.tokenizer).__name__ == "Qwen2Tokenizer"
    assert 256 < len(proc.tokenizer) <= 2100


def test_config_ids_match_tokenizer(tiny_ckpt):
    from transformers import AutoConfig

    from mimo_sft.data.processor import load_processor

    cfg = AutoConfig.from_pretrained(tiny_ckpt)
    tok = load_processor(tiny_ckpt).tokenizer
    assert cfg.text_config.vocab_size >= len(tok)
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    # specials are single tokens, text round-trips
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False)[0] == tok.convert_tokens_to_ids("<|im_start|>")
    text = "The image shows a purple square, total 42.07!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_assistant_mask_and_forward(tiny_ckpt):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_ckpt)
    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt).eval()
    out = proc.apply_chat_template(
        _messages(_image()), tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt"
    )
    ids = out["input_ids"][0]
    mask = torch.as_tensor(out.pop("assistant_masks")[0]).bool()
    assert proc.tokenizer.decode(ids[mask]) == "The colour is red.<|im_end|>"
    n_img = int((ids == model.config.image_token_id).sum())
    merge = model.config.vision_config.spatial_merge_size
    assert n_img == int(out["image_grid_thw"].prod()) // merge**2
    assert n_img <= 64  # small defaults keep images cheap
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (1, ids.numel(), model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_load_processor_on_real_layout_without_torchvision(tiny_ckpt, tmp_path):
    """A real Qwen2.5-VL folder names Qwen2_5_VLProcessor (needs a video processor) and has a template
    without generation markers: load_processor still builds the image-only processor."""
    from mimo_sft.data.processor import QwenVLImageOnlyProcessor, load_processor

    real = tmp_path / "real"
    real.mkdir()
    for f in ("tokenizer.json", "config.json"):
        shutil.copy(tiny_ckpt / f, real / f)
    tok_cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    tok_cfg["processor_class"] = "Qwen2_5_VLProcessor"
    (real / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    ip = json.loads((tiny_ckpt / "processor_config.json").read_text())["image_processor"]
    ip.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor",
              min_pixels=ip["size"]["shortest_edge"], max_pixels=ip["size"]["longest_edge"])
    (real / "preprocessor_config.json").write_text(json.dumps(ip))
    (real / "chat_template.json").write_text(json.dumps({"chat_template": UPSTREAM_QWEN2_VL_TEMPLATE}))

    proc = load_processor(real)
    assert type(proc) is QwenVLImageOnlyProcessor
    out = proc.apply_chat_template(_messages(_image()), tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    ids = np.asarray(out["input_ids"][0])
    assert proc.tokenizer.decode(ids[np.asarray(out["assistant_masks"][0], bool)]) == "The colour is red.<|im_end|>"


def test_script_options(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_qwen_vl

    out = tmp_path / "ck"
    rc = make_tiny_qwen_vl.main([str(out), "--no-tie-embeddings", "--patch-size", "8", "--text-hidden", "32",
                                 "--heads", "2", "--kv-heads", "1", "--max-pixels", str(16 * 16 * 16)])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert cfg["vision_config"]["patch_size"] == 8
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert make_tiny_qwen_vl.main([str(tmp_path / "bad"), "--vision-hidden", "30"]) == 2


def test_missing_folder_is_user_error(tmp_path):
    from mimo_sft.data.processor import load_processor
    from mimo_sft.errors import UserError

    with pytest.raises(UserError, match="hf_model"):
        load_processor(tmp_path / "nope")


def test_foreign_template_without_generation_markers_is_kept(tiny_ckpt, tmp_path):
    """A template of another layout is used as it is: the assistant's spans come from its prefixes
    (tests/test_chat_templates.py); one that cannot render text and image parts is refused at load."""
    from mimo_sft.data.processor import load_processor
    from mimo_sft.errors import UserError

    odd = tmp_path / "odd"
    shutil.copytree(tiny_ckpt, odd)
    tok_cfg = json.loads((odd / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (odd / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    plain = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{{ p['text'] or '<|image_pad|>' }}"
             "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    (odd / "chat_template.jinja").write_text(plain)
    assert load_processor(odd).chat_template == plain
    (odd / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] + '\n' }}{% endfor %}")
    with pytest.raises(UserError, match="cannot render a conversation"):
        load_processor(odd)


def test_template_renders_qwens_exact_text(tiny_ckpt):
    """Our template (with generation markers) must render byte-for-byte what Qwen's renders."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from mimo_sft.data.processor import QWEN_VL_CHAT_TEMPLATE, _PROBE

    ours, _ = render_jinja_template(conversations=_PROBE, chat_template=QWEN_VL_CHAT_TEMPLATE)
    theirs, _ = render_jinja_template(conversations=_PROBE, chat_template=UPSTREAM_QWEN2_VL_TEMPLATE)
    assert ours == theirs
    assert "A1<|im_end|>\n<|im_start|>user\nQ2" in ours[0]
