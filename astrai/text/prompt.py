"""Prompts into token ids, with the same template and tokenizer code as preprocessing (astrai.data).

- a string is raw text to continue, encoded as the tokenizer does by default (its post-processor
  may add BOS), like `tokenizer(text)` in transformers;
- a list of messages is a conversation: rendered once by the chat template with the generation
  prompt, then encoded without added specials (the template writes BOS itself where it has one),
  which is exactly how a template section is tokenized in preprocessing;
- a list of ints is taken as token ids.

`end_of_turn_id` finds the special token a template closes an assistant turn with (ChatML's
<|im_end|>), the token SFT trains the model to emit, so chat generation stops there even when the
tokenizer's EOS is a different token.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jinja2

from astrai.text.template import ChatTemplate, TemplateRaised, resolve_template
from astrai.text.tokenizer import Tokenizer

Prompt = Union[str, Sequence[int], Sequence[dict]]
_PROBE = "\x00astrai-probe\x00"


def is_chat(prompt: Prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


def chat_template_for(tokenizer: Tokenizer, spec: Optional[str] = None) -> Optional[ChatTemplate]:
    """The template named by `spec` (bundled name or path), else the tokenizer's own, else None."""
    if spec is not None:
        return resolve_template(spec, tokenizer)
    if tokenizer.chat_template:
        return resolve_template("tokenizer", tokenizer)
    return None


def encode_prompt(prompt: Prompt, tokenizer: Optional[Tokenizer], template: Optional[ChatTemplate]) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        return tokenizer.tok.encode(prompt).ids
    if is_chat(prompt):
        if tokenizer is None or template is None:
            raise ValueError("a chat conversation needs a tokenizer and a chat template (the tokenizer has none: "
                             "pass chat_template, e.g. 'chatml')")
        text = template.render(list(prompt), add_generation_prompt=True, special_tokens=tokenizer.special_tokens_map)
        return tokenizer.tok.encode(text, add_special_tokens=False).ids
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    return ids


def end_of_turn_id(tokenizer: Tokenizer, template: ChatTemplate) -> Optional[int]:
    """The first special token the template writes after an assistant message's text, if any."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = template.render(msgs, special_tokens=tokenizer.special_tokens_map)
    except (TemplateRaised, jinja2.TemplateError):  # refuses the probe: no end-of-turn we can find
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    for tid in tokenizer.tok.encode(text[at + len(_PROBE):], add_special_tokens=False).ids:
        if tid in tokenizer.special_ids:
            return tid
    return None
