"""Image-only Qwen-VL processor: build a tiny one, load a real one, without torchvision.

Why this module exists: transformers' ``Qwen2_5_VLProcessor`` insists on a video processor, and
every video processor needs torchvision, which cannot be installed beside the CPU torch wheel. We
define ``QwenVLImageOnlyProcessor`` (same behaviour, no video slot), register it with
``AutoProcessor`` so a folder that names it loads back as that class, and ``load_processor`` builds
it from the tokenizer + PIL image processor of any Qwen2.5-VL folder (tiny or real).

``write_tiny_processor`` trains a small byte-level BPE with Qwen's split regex and pins Qwen's special
tokens right after the BPE vocabulary, so tests get real tokenization with small logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from mimo_sft.data.template_spans import has_generation_markers
from mimo_sft.errors import UserError

# Qwen2.5-VL's special tokens in the order of their real ids (151643...); the tiny tokenizer pins
# them in this order directly after its BPE vocabulary.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL's chat template with ``{% generation %}`` around what the assistant writes (its content
# and the closing <|im_end|>), so ``return_assistant_tokens_mask=True`` marks exactly those tokens.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endgeneration %}{{ '\\n' }}"  # trim_blocks would eat a literal newline here
    "{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_DEFAULT_SYSTEM = ("{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
                   "<|im_end|>\n{% endif %}")
assert _DEFAULT_SYSTEM in QWEN_VL_CHAT_TEMPLATE
# Qwen3-VL's (instruct) conversation layout: Qwen2-VL's without the default system turn (a system
# message is rendered only when the conversation has one), with the same {% generation %} spans.
QWEN3_VL_CHAT_TEMPLATE = QWEN_VL_CHAT_TEMPLATE.replace(_DEFAULT_SYSTEM, "")

# Qwen3.5's conversation layout, as its released chat_template.jinja renders a conversation (Qwen/Qwen3.5-*: the
# sizes differ only in the generation prompt's thinking default): no default system turn; every turn's text
# trimmed; an assistant turn after the last user turn opens with a think block -- "<think>\n" + its reasoning +
# "\n</think>\n\n", the reasoning being what the content writes before "</think>", so an answer without one
# gets the empty "<think>\n\n</think>\n\n" -- and earlier assistant turns are their answers alone (reasoning
# dropped). The {% generation %} span is what the model writes after the template's own text: the answer and
# <|im_end|>, with its reasoning and "</think>" when the content has one; the empty block is the template's,
# as in the thinking-off prompt, so SFT never trains the model to write it. Tool turns are not rendered.
QWEN3_5_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- macro text_of(content, count) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable and content is not mapping %}{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}"
    "{%- if count %}{%- set image_count.value = image_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'video' in item or item.type == 'video' %}"
    "{%- if count %}{%- set video_count.value = video_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set text = text_of(message.content, message.role != 'system')|trim %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set answer = text %}{%- set thought = '' %}"
    "{%- if '</think>' in text %}"
    "{%- set thought = (text.split('</think>')[0].rstrip('\n').split('<think>')|last).lstrip('\n')|trim %}"
    "{%- set answer = (text.split('</think>')|last).lstrip('\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last_user and thought %}"
    "{{- '<think>\n' }}{% generation %}{{- thought + '\n</think>\n\n' + answer + '<|im_end|>' }}{% endgeneration %}"
    "{%- elif loop.index0 > ns.last_user %}"
    "{{- '<think>\n\n</think>\n\n' }}{% generation %}{{- answer + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{% generation %}{{- answer + '<|im_end|>' }}{% endgeneration %}{%- endif %}"
    "{{- '\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)

#: the marked chat templates by the name a family's descriptor gives (``FamilySpec.chat_template``)
CHAT_TEMPLATES = {"qwen2_vl": QWEN_VL_CHAT_TEMPLATE, "qwen3_vl": QWEN3_VL_CHAT_TEMPLATE,
                  "qwen3_5": QWEN3_5_CHAT_TEMPLATE}


def family_chat_template(model_type) -> str:
    """The marked chat template of the family that reads ``model_type`` (the default family's otherwise)."""
    from mimo_sft.config.families import default_family, family_for_model_type

    spec = family_for_model_type(model_type) or default_family()
    return CHAT_TEMPLATES[spec.chat_template]


class QwenVLImageOnlyProcessor(ProcessorMixin):
    """``Qwen2_5_VLProcessor`` without the video slot (so no torchvision is ever needed).

    Text with ``<|image_pad|>`` is expanded to one placeholder per merged patch, exactly as the
    upstream processor does, and ``mm_token_type_ids`` is returned (the model needs it for mRoPE).
    """

    return_mm_token_type_ids = True

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(self.video_token)
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        merge_length = self.image_processor.merge_size**2
        return self.image_token * int(image_inputs["image_grid_thw"][image_idx].prod() // merge_length)

    @property
    def model_input_names(self):
        return super().model_input_names + ["mm_token_type_ids"]


def resolve_image_backend(choice: str) -> str:
    """``--image-backend``: "pil" or "torchvision"; "auto" is what ``AutoProcessor.from_pretrained`` picks here
    (torchvision's backend where torchvision imports). The two resize differently (a 517x733 image: pixel values
    up to 0.345 apart after normalisation), and training should see what the user's inference sees."""
    from transformers.utils import is_torchvision_available

    if choice not in ("auto", "pil", "torchvision"):
        raise UserError(f"--image-backend {choice}: use auto, pil or torchvision")
    if choice == "pil":
        return "pil"
    if is_torchvision_available():
        return "torchvision"
    if choice == "torchvision":
        raise UserError("--image-backend torchvision: torchvision is not installed; install the release paired with "
                        "your torch (make install does) or use --image-backend pil")
    return "pil"


def _register_families() -> None:
    """Register the processor for every family's config class (``config.families``: its ``model_type``s),
    so ``AutoProcessor`` resolves the class name written in processor_config.json (unregistered,
    AutoProcessor silently falls back to the bare tokenizer)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from mimo_sft.config.families import model_types

    for model_type in model_types():
        AutoProcessor.register(CONFIG_MAPPING[model_type], QwenVLImageOnlyProcessor, exist_ok=True)


_register_families()


# --------------------------------------------------------------------------- tiny tokenizer

def _tokenizer_corpus() -> list[str]:
    """A fixed, offline training corpus: chat-template words, demo-data words, plain English."""
    colours = "red green blue yellow orange purple black white pink brown grey cyan".split()
    words = (
        "system user assistant You are a helpful assistant. What colour is shown in the image? "
        "The image shows the number and the colour. Read the receipt and give the total amount. "
        "This document page contains a table with several rows of numbers and a title at the top. "
        "Answer the question about the picture. Describe the image. How many items are listed? "
        "The total is dollars. The shop name is written at the top of the receipt. "
        "Hello, how are you today? I am fine, thank you. Please summarise the text in one sentence. "
        "A quick brown fox jumps over the lazy dog. The weather is sunny and warm. "
        "first second third fourth fifth page line item price date time invoice number colour color "
    )
    lines = [words]
    for i, c in enumerate(colours):
        lines.append(f"The image shows a {c} square with the number {i * 7 % 100}. The colour is {c}.")
        lines.append(f"Picture {i}: {c} box, total {i * 13}.{i:02d} on line {i + 1}")
    lines += [" ".join(str(n) for n in range(200)), "\n".join(["def f(x):", "    return x + 1", ""])]
    return lines * 4


def build_tiny_tokenizer(vocab_size: int = 1024):
    """Train a byte-level BPE with Qwen's pre-tokenizer; return a transformers ``Qwen2Tokenizer``.

    Special tokens get the ids ``len(bpe_vocab) + i`` in ``QWEN_SPECIAL_TOKENS`` order, so they are
    deterministic for a given vocab_size (the corpus is fixed).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    base = len(vocab)
    for i, t in enumerate(QWEN_SPECIAL_TOKENS):
        vocab[t] = base + i
    qtok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    for t in QWEN_SPECIAL_TOKENS:
        assert qtok.convert_tokens_to_ids(t) == vocab[t], f"special token {t} moved"
    return qtok


def write_tiny_processor(
    out_dir: str | os.PathLike,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    vocab_size: int = 1024,
    image_mean=None,
    image_std=None,
    chat_template: str = QWEN_VL_CHAT_TEMPLATE,
) -> QwenVLImageOnlyProcessor:
    """Write tokenizer, PIL image processor and chat template for an image-only processor.

    Defaults keep images small: at most 64 merged tokens (``max_pixels = 64 * (patch*merge)^2``)
    and at least 4.
    """
    factor = patch_size * merge_size
    min_pixels = min_pixels if min_pixels is not None else 4 * factor * factor
    max_pixels = max_pixels if max_pixels is not None else 64 * factor * factor
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        **({"image_mean": list(image_mean)} if image_mean is not None else {}),
        **({"image_std": list(image_std)} if image_std is not None else {}),
    )
    tokenizer = build_tiny_tokenizer(vocab_size)
    tokenizer.chat_template = chat_template
    processor = QwenVLImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out))
    return processor


# --------------------------------------------------------------------------- loading

def load_processor(model_dir: str | os.PathLike) -> QwenVLImageOnlyProcessor:
    """The image-only processor for a Qwen2.5-VL folder (ours or a real one), with no torchvision.

    A real checkpoint's processor_config names ``Qwen2_5_VLProcessor``, which needs a video
    processor; we instead assemble ours from its tokenizer and the PIL image processor.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise UserError(f"model.hf_model: {model_dir} is not a folder; point --hf-model at a Qwen2.5-VL checkpoint folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"model.hf_model: cannot load the tokenizer/image processor from {path} ({first}); "
            "the folder needs tokenizer files and preprocessor_config.json"
        ) from None
    if not isinstance(image_processor, Qwen2VLImageProcessorPil):
        image_processor = Qwen2VLImageProcessorPil(**_pil_kwargs(image_processor))
    template = tokenizer.chat_template or _read_chat_template(path)
    if template is None:
        raise UserError(f"model.hf_model: {path} has no chat template (chat_template.jinja / .json); add Qwen's chat template")
    if not has_generation_markers(template):
        # Released Qwen templates lack generation markers; the family's marked one renders the same text and
        # marks exactly the assistant's. Any other template is kept: the preprocessor finds the assistant's
        # spans by rendering each conversation's prefixes (data.template_spans).
        probe = _render_probe(template, tokenizer)
        if probe[0].startswith("<error"):
            raise UserError(f"model.hf_model: the chat template of {path} cannot render a conversation of user and "
                            f"assistant messages with text and image parts ({probe[0][1:-1]}); fix the template")
        marked = family_chat_template(_model_type(path))
        if probe == _render_probe(marked, tokenizer):
            template = marked
    return QwenVLImageOnlyProcessor(image_processor, tokenizer, chat_template=template)


_PROBE = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q1"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A1"}]},
     {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "image"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A"}]}],
]


def _render_probe(template: str, tokenizer) -> list[str]:
    """Text a template renders for a few conversation shapes (used to compare templates)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        out, _ = render_jinja_template(conversations=_PROBE, chat_template=template, **tokenizer.special_tokens_map)
    except Exception as err:  # a template that cannot render our shapes is a user-facing problem
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return [f"<error {type(err).__name__}: {first}>"]
    return out


def _model_type(path: Path):
    """config.json's ``model_type`` (None without a readable config.json)."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _pil_kwargs(ip) -> dict:
    size = dict(ip.size) if getattr(ip, "size", None) else {}
    return dict(
        patch_size=ip.patch_size,
        merge_size=ip.merge_size,
        temporal_patch_size=ip.temporal_patch_size,
        min_pixels=size.get("shortest_edge"),
        max_pixels=size.get("longest_edge"),
        image_mean=ip.image_mean,
        image_std=ip.image_std,
    )


def _read_chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = path / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text()).get("chat_template")
    return None
