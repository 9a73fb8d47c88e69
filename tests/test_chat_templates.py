"""A chat template without ``{% generation %}`` markers trains (issue 44 item 3): each assistant turn's span comes
from rendering the conversation's prefixes, and equals, token for token, the span a marked copy of the same
template gives -- on templates with a default system prompt, with thinking blocks and with tool calls, with images
expanded before and inside the spans. A template that is not prefix-stable on a row's conversation is refused in one
line that shows where the renderings part.

Each template is a fine-tuned derivative's (it renders differently from Qwen's, so the family's marked template
cannot stand in); its marked copy wraps, by hand, what the model writes after the generation prompt.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from PIL import Image

from data_fixtures import tiny_ckpt  # noqa: F401  (session fixture)
from mimo_sft.data.processor import QWEN_VL_CHAT_TEMPLATE
from mimo_sft.errors import UserError


def _unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


# Qwen2-VL's layout with the derivative's own default system turn (written when the first message is not a system one)
SYSTEM = QWEN_VL_CHAT_TEMPLATE.replace("You are a helpful assistant.", "You are Receipt Reader. Answer briefly.")

# The text of a message's content: a string, or text and image parts (as the data path gives them)
_TEXT_OF = (
    "{%- macro text_of(content) %}{%- if content is string %}{{- content }}{%- else %}{%- for p in content %}"
    "{%- if p.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif p.type == 'text' %}{{- p.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
)

# Qwen3's thinking layout: every text trimmed, an answer's reasoning (what its text writes before </think>) in a
# think block. KEEP says which assistant turns show it: every one, or (Qwen3's own) only those after the last user
# message, so that an earlier answer loses its block once a user turn follows -- not prefix-stable.
_THINKING = _TEXT_OF + (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set text = text_of(m.content)|trim %}"
    "{%- if m.role == 'assistant' %}{%- set answer = text %}{%- set thought = '' %}"
    "{%- if '</think>' in text %}{%- set thought = (text.split('</think>')[0].split('<think>')|last)|trim %}"
    "{%- set answer = (text.split('</think>')|last)|trim %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if KEEP %}{% generation %}{{- '<think>\n' + thought + '\n</think>\n\n' + answer + '<|im_end|>' }}"
    "{% endgeneration %}"
    "{%- else %}{% generation %}{{- answer + '<|im_end|>' }}{% endgeneration %}{%- endif %}{{- '\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + text + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
THINKING_KEPT = _THINKING.replace("KEEP", "true")
THINKING_QWEN3 = _THINKING.replace("KEEP", "loop.index0 > ns.last_user")

# Qwen2.5's tool-call layout with a default system turn: an answer's calls follow its text as <tool_call> blocks,
# consecutive tool results share one user turn of <tool_response> blocks.
TOOLS = _TEXT_OF + (
    "{%- if not messages or messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\nYou are a tool-using assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' or m.role == 'user' %}{{- '<|im_start|>' + m.role + '\n' + text_of(m.content) + "
    "'<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}{% generation %}{{- text_of(m.content) }}"
    "{%- for call in m.tool_calls or [] %}{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' + call.arguments|tojson + '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + text_of(m.content) + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def _png(w: int, h: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=g, dtype=torch.uint8).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _text(s: str) -> dict:
    return {"type": "text", "text": s}


def _msg(role: str, *parts) -> dict:
    return {"role": role, "content": [p if isinstance(p, dict) else _text(p) for p in parts]}


IMAGE = {"type": "image"}
# (messages, number of images) in the shapes rows have: an image before a span, one inside a span, a system
# message, an empty answer, two answers in a row, a conversation ending on a user turn
CONVERSATIONS = [
    ([_msg("user", IMAGE, "What is the total?"), _msg("assistant", "The total is 12.40.")], 1),
    ([_msg("user", IMAGE, "Which shop?"), _msg("assistant", "Corner Deli."), _msg("user", IMAGE, "And this one?"),
      _msg("assistant", "The same shop, a day later.")], 2),
    ([_msg("system", "Be terse."), _msg("user", "Draw it."), _msg("assistant", "Here:", IMAGE, "a square.")], 1),
    ([_msg("user", "Say nothing."), _msg("assistant", ""), _msg("user", "Now say hi."), _msg("assistant", "hi")], 0),
    ([_msg("user", "Two answers?"), _msg("assistant", "One."), _msg("assistant", "Two.")], 0),
    ([_msg("user", "Hello"), _msg("assistant", "Hi there."), _msg("user", "Bye")], 0),
]
SINGLE_TURN_THOUGHTS = [
    ([_msg("user", IMAGE, "Colour?"), _msg("assistant", "<think>\nIt is mostly red.\n</think>\n\nRed.")], 1),
    ([_msg("user", IMAGE, "Shape?"), _msg("assistant", "A square.")], 1),
    ([_msg("system", "Think first."), _msg("user", "2+2?"), _msg("assistant", "<think>Add them.</think>4")], 0),
]


def _folder(tiny_ckpt, tmp_path, name: str, template: str):
    """The tiny checkpoint with ``template`` as its chat template (chat_template.jinja)."""
    folder = tmp_path / name
    shutil.copytree(tiny_ckpt, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def _pair(tiny_ckpt, tmp_path, template: str):
    """Preprocessors of the marked template and of the same template without its markers."""
    from mimo_sft.data.preprocess import SamplePreprocessor

    marked = SamplePreprocessor(_folder(tiny_ckpt, tmp_path, "marked", template), seq_length=4096)
    plain = SamplePreprocessor(_folder(tiny_ckpt, tmp_path, "plain", _unmarked(template)), seq_length=4096)
    assert marked.chat_template == template and plain.chat_template == _unmarked(template)  # neither replaced
    return marked, plain


def _assert_same_masks(marked, plain, conversations, refs_for=None) -> list[str]:
    """Both preprocessors give every conversation the same tokens, labels and loss mask; the supervised text."""
    out = []
    for k, (messages, n_images) in enumerate(conversations):
        refs = [_png(60 + 10 * j, 50, seed=j) for j in range(n_images)]
        a = marked.encode(messages, refs, k, need_pixels=False)
        b = plain.encode(messages, refs, k, need_pixels=False)
        for key in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(a[key], b[key]), (k, key)
        assert a["loss_mask"].any()
        if n_images:
            assert int((b["input_ids"] == plain.image_token_id).sum()) > n_images  # placeholders were expanded
        out.append(plain.tokenizer.decode(b["labels"][b["loss_mask"] > 0]))
    return out


def test_default_system_prompt(tiny_ckpt, tmp_path):
    marked, plain = _pair(tiny_ckpt, tmp_path, SYSTEM)
    assert plain.render(CONVERSATIONS[0][0])[0].startswith("<|im_start|>system\nYou are Receipt Reader.")
    got = _assert_same_masks(marked, plain, CONVERSATIONS)
    assert got[1] == "Corner Deli.<|im_end|>The same shop, a day later.<|im_end|>"
    assert got[2].startswith("Here:<|vision_start|><|image_pad|>") and got[2].endswith("a square.<|im_end|>")
    assert got[3] == "<|im_end|>hi<|im_end|>"
    assert got[4] == "One.<|im_end|>Two.<|im_end|>"


def test_thinking_blocks(tiny_ckpt, tmp_path):
    marked, plain = _pair(tiny_ckpt, tmp_path, THINKING_KEPT)
    got = _assert_same_masks(marked, plain, SINGLE_TURN_THOUGHTS + CONVERSATIONS)
    assert got[0] == "<think>\nIt is mostly red.\n</think>\n\nRed.<|im_end|>"
    assert got[1] == "<think>\n\n</think>\n\nA square.<|im_end|>"
    # Qwen3's layout is prefix-stable on single-turn rows: those train, with the same masks as the marked copy
    marked3, plain3 = _pair(tiny_ckpt, tmp_path / "qwen3", THINKING_QWEN3)
    assert _assert_same_masks(marked3, plain3, SINGLE_TURN_THOUGHTS) == got[:3]


def test_tool_calls(tiny_ckpt, tmp_path):
    marked, plain = _pair(tiny_ckpt, tmp_path, TOOLS)
    call = {"type": "function", "function": {"name": "lookup_price", "arguments": {"item": "coffee", "size": 2}}}
    other = {"type": "function", "function": {"name": "currency", "arguments": {"code": "EUR"}}}
    conversation = [
        _msg("user", IMAGE, "What does the coffee cost in euros?"),
        {**_msg("assistant", "Let me look."), "tool_calls": [call, other]},
        _msg("tool", '{"price": 3.1}'), _msg("tool", '{"rate": 0.9}'),
        _msg("assistant", "About 2.79 euros."),
        {**_msg("assistant"), "tool_calls": [call]},  # a call without text
        _msg("tool", '{"price": 3.1}'),
        _msg("assistant", "Still 3.10 dollars."),
    ]
    got = _assert_same_masks(marked, plain, [(conversation, 1)] + CONVERSATIONS)
    text = plain.render(conversation)[0]
    assert '<|im_start|>user\n<tool_response>\n{"price": 3.1}\n</tool_response>\n<tool_response>' in text
    assert got[0] == ('Let me look.\n<tool_call>\n{"name": "lookup_price", "arguments": {"item": "coffee", "size": 2}}'
                      '\n</tool_call>\n<tool_call>\n{"name": "currency", "arguments": {"code": "EUR"}}\n</tool_call>'
                      '<|im_end|>About 2.79 euros.<|im_end|>\n<tool_call>\n{"name": "lookup_price", "arguments": '
                      '{"item": "coffee", "size": 2}}\n</tool_call><|im_end|>Still 3.10 dollars.<|im_end|>')


def test_not_prefix_stable_is_refused_in_one_line(tiny_ckpt, tmp_path):
    """Qwen3's thinking layout drops an earlier answer's think block once a user turn follows: a multi-turn row
    is refused, naming the message and showing both renderings; check-data lists the row (exit 1)."""
    from mimo_sft.data.check import ChunkReport, check_sample
    from mimo_sft.data.preprocess import SamplePreprocessor

    pre = SamplePreprocessor(_folder(tiny_ckpt, tmp_path, "qwen3", _unmarked(THINKING_QWEN3)), seq_length=4096)
    messages = [_msg("user", "Colour?"), _msg("assistant", "Red."), _msg("user", "Shape?"), _msg("assistant", "Round.")]
    with pytest.raises(UserError) as err:
        pre.encode(messages, [], 7, need_pixels=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith("sample 7: the chat template of ")
    assert "is not prefix-stable on this conversation (user, assistant, user, assistant): assistant message 2" in line
    assert r"assistant\n<think>\n\n</think>\n\nRed." in line and r"assistant\nRed.<|im_end|>\n<|im_start|>user" in line
    assert "{% generation %}" in line

    class Rows:
        def __getitem__(self, i):
            return messages, []

    report = ChunkReport()
    check_sample(Rows(), pre, 3, report)
    assert report.counts["bad_samples"] == 1 and "not prefix-stable" in report.problems[0].reason


def test_load_keeps_a_derivative_template_and_refuses_one_that_cannot_render(tiny_ckpt, tmp_path):
    from mimo_sft.data.processor import load_processor

    assert load_processor(_folder(tiny_ckpt, tmp_path, "tools", _unmarked(TOOLS))).chat_template == _unmarked(TOOLS)
    # a released Qwen template is still read with the family's marked copy (its spans are exact)
    assert load_processor(_folder(tiny_ckpt, tmp_path, "qwen", _unmarked(QWEN_VL_CHAT_TEMPLATE))).chat_template == (
        QWEN_VL_CHAT_TEMPLATE)
    # a text-only model's template adds strings to the content: our list-of-parts messages cannot render
    text_only = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError) as err:
        load_processor(_folder(tiny_ckpt, tmp_path, "text", text_only))
    assert "\n" not in str(err.value) and "cannot render a conversation of user and assistant messages" in str(err.value)


def test_a_row_the_template_raises_on_is_one_line(tiny_ckpt, tmp_path):
    from mimo_sft.data.preprocess import SamplePreprocessor

    strict = ("{% if messages and messages[0].role == 'assistant' %}{{ raise_exception('Conversations must start "
              "with a user message') }}{% endif %}" + _unmarked(SYSTEM))
    pre = SamplePreprocessor(_folder(tiny_ckpt, tmp_path, "strict", strict), seq_length=512)
    assert pre.encode(CONVERSATIONS[3][0], [], 0, need_pixels=False)["loss_mask"].any()
    with pytest.raises(UserError) as err:
        pre.encode([_msg("assistant", "Hello."), _msg("user", "Hi")], [], 4, need_pixels=False)
    assert str(err.value).startswith("sample 4: the chat template of ") and "\n" not in str(err.value)
    assert "cannot render this conversation (TemplateError: Conversations must start with a user message)" in str(err.value)
