"""Where each assistant turn sits in a rendered conversation, for a chat template with or without markers.

Why two ways: a template with ``{% generation %}`` markers says exactly which characters the assistant
writes (transformers returns their spans), so it is used as it is. A released Qwen template carries no
markers; the family's marked copy stands in for one that renders the same text (``data.processor``). Any
other template -- a fine-tuned derivative's own -- is rendered on the conversation's prefixes: assistant
turn ``i`` adds to ``messages[:i]`` rendered with the generation prompt what the model writes in reply,
and its span is that addition without trailing whitespace (what follows the end-of-turn token, Qwen's
newline after ``<|im_end|>``, is the template's, as the marked templates have it).

That reading holds only where each prefix's rendering is a prefix of the next and of the whole
conversation's. It is checked on every row (the renderings are needed for the spans anyway), and a row
where it fails is refused in one line showing where the two renderings part (Qwen3's thinking template,
for one, drops an earlier turn's reasoning once a later user turn follows).

Cost: two renders per assistant turn (text only, each as long as its prefix) beside the one a marked
template needs; the text is tokenized once, by the caller.
"""

from __future__ import annotations

import os
import re

from mimo_sft.errors import UserError

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` marks the assistant's text with ``{% generation %}``."""
    return bool(_MARKER.search(template))


def _rendered(conversations: list, template: str, where: str, origin: str, **kw):
    """transformers' ``render_jinja_template``; a template that raises is a one-line ``UserError``."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        return render_jinja_template(conversations=conversations, chat_template=template, **kw)
    except Exception as err:  # noqa: BLE001 - the template's own error (raise_exception, a missing key, ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        of = f" of {origin}" if origin else ""
        raise UserError(f"{where}the chat template{of} cannot render this conversation ({type(err).__name__}: "
                        f"{first}); fix the template or the row") from None


def render(template: str, conversations: list, special: dict, *, generation_prompt: bool = False,
           where: str = "", origin: str = "") -> list[str]:
    """The text ``template`` renders for each conversation."""
    return _rendered(conversations, template, where, origin, add_generation_prompt=generation_prompt, **special)[0]


def marked_spans(template: str, messages: list, special: dict, *, where: str = "",
                 origin: str = "") -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the ``{% generation %}`` blocks)."""
    rendered, spans = _rendered([messages], template, where, origin, return_assistant_tokens_mask=True,
                                add_generation_prompt=False, **special)
    return rendered[0], list(spans[0])


def prefix_spans(template: str, messages: list, special: dict, *, where: str = "",
                 origin: str = "") -> tuple[str, list[tuple[int, int]]]:
    """(text, character span of each assistant turn) of a template without markers, from its prefixes.

    ``where`` opens an error line (``"sample 7: "``); ``origin`` names the template (its folder)."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    ends_with_turn = bool(turns) and turns[-1] == len(messages) - 1
    before = render(template, [messages[:i] for i in turns], special, generation_prompt=True, where=where,
                    origin=origin)
    upto = render(template, [messages[:i + 1] for i in turns] + ([] if ends_with_turn else [messages]), special,
                  where=where, origin=origin)
    text = upto[-1]
    spans = []
    for i, head, whole in zip(turns, before, upto):
        if not whole.startswith(head):
            raise _unstable(where, origin, messages, head, whole, f"the text before assistant message {i + 1} "
                            "with the generation prompt reads {a}, but with that message {b}")
        if not text.startswith(whole):
            raise _unstable(where, origin, messages, whole, text, f"assistant message {i + 1} reads {{a}} as the "
                            "last message, but {b} with the messages after it")
        start, end = len(head), len(whole.rstrip())
        if end > start:
            spans.append((start, end))
    return text, spans


def _unstable(where: str, origin: str, messages: list, a: str, b: str, what: str) -> UserError:
    """The one line refusing a row on which the template is not prefix-stable, showing where ``a`` and ``b`` part."""
    at = len(os.path.commonprefix([a, b]))
    lo = max(0, at - 20)

    def near(s: str) -> str:
        return repr(("..." if lo else "") + s[lo:at + 32] + ("..." if len(s) > at + 32 else ""))

    roles = ", ".join(str(m.get("role")) for m in messages)
    of = f" of {origin}" if origin else ""
    return UserError(f"{where}the chat template{of} has no {{% generation %}} markers and is not prefix-stable on "
                     f"this conversation ({roles}): {what.format(a=near(a), b=near(b))}; wrap what the assistant "
                     "writes in {% generation %}...{% endgeneration %} in the template (docs/data.md)")
