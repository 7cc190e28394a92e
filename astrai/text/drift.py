"""Template drift: training data rendered with another chat template than the model serves with.

A model learns the exact text its data was rendered to. `generate`, `chat` and `serve` render a
conversation with the checkpoint's own template (its tokenizer's); data rendered with another one
(ChatML where the model's template adds a default system prompt, other separators) teaches a format
the model never sees at inference, and nothing fails. So a template other than the model's is
refused before any work unless the pipeline says `chat_template_mismatch: allow`.

Two templates are compared by what they render, not by their source text: the sample conversations
below (without and with a system message) as training renders them, and their prompts as serving
renders them (with the generation prompt). `template_difference` names both templates and shows
where the first render differs.
"""

from __future__ import annotations

from typing import Optional

from astrai.text.template import ChatTemplate, TemplateLimit

USER, ANSWER = "What is the capital of France?", "Paris."
SAMPLES = (
    [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": USER},
     {"role": "assistant", "content": ANSWER}],
)
SHOWN = 60  # characters of each render shown from the first difference on


def _render(template: ChatTemplate, messages: list[dict], gen: bool, special_tokens: dict, kwargs: dict) -> str:
    try:
        return template.render(messages, add_generation_prompt=gen, special_tokens=special_tokens, **kwargs)
    except TemplateLimit:
        raise
    except Exception as e:  # a template that refuses the sample (raise_exception) renders it as its refusal
        return f"<the template refuses it: {e}>"


def first_difference(a: str, b: str) -> Optional[int]:
    """The first character position where a and b differ (None when they are equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def template_difference(data: ChatTemplate, model: ChatTemplate, special_tokens: dict,
                        template_kwargs: Optional[dict] = None) -> Optional[str]:
    """None when `data` renders the samples exactly as `model` does; else what differs, for a person."""
    if data.source == model.source:
        return None
    kwargs = dict(template_kwargs or {})
    for messages in SAMPLES:
        for what, msgs, gen in (("conversation", messages, False), ("prompt", messages[:-1], True)):
            a = _render(data, msgs, gen, special_tokens, kwargs)
            b = _render(model, msgs, gen, special_tokens, kwargs)
            at = first_difference(a, b)
            if at is not None:
                shown = " + ".join(f"{m['role']} {m['content']!r}" for m in msgs)
                return (f"the data is rendered with chat template {data.name}, but the model serves with "
                        f"{model.name}; on the sample {what} [{shown}] the renders differ at character {at}: "
                        f"data {a[at:at + SHOWN]!r} vs model {b[at:at + SHOWN]!r}")
    return None


MISMATCH_FIX = ("render with the model's own template (chat_template: tokenizer, the default), or set "
                "chat_template_mismatch: allow in the pipeline to train on this one anyway")
