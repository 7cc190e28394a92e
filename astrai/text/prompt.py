"""Prompts into token ids, with the same template and tokenizer code as preprocessing (astrai.data).

- a string is raw text to continue, encoded as the tokenizer does by default (its post-processor
  may add BOS), like `tokenizer(text)` in transformers;
- a list of messages is a conversation: rendered once by the chat template with the generation
  prompt, then encoded without added specials (the template writes BOS itself where it has one),
  which is exactly how a template section is tokenized in preprocessing;
- a list of ints is taken as token ids.

`prompt_problem` says why something is none of these (a number, null, a message without role or
content), so a file of prompts is checked line by line before any work; shared with the server.

`end_of_turn_id` finds the special token a template closes an assistant turn with (ChatML's
<|im_end|>), the token SFT trains the model to emit, so chat generation stops there even when the
tokenizer's EOS is a different token.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from astrai.errors import InvalidRequest
from astrai.text.template import ChatTemplate, TemplateLimit, TemplateRaised, resolve_template
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


def prompt_problem(prompt) -> Optional[str]:
    """Why `prompt` is not text, a conversation or token ids (None when it is one): what a person
    reads after the file:line or request it came from."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, (list, tuple)):
        got = "null" if prompt is None else type(prompt).__name__
        return f"a prompt is text, a list of messages ({{role, content}}) or a list of token ids, not {got}"
    if not prompt:
        return "the prompt is an empty list: give text, messages or token ids"
    if isinstance(prompt[0], dict):
        for i, m in enumerate(prompt):
            problem = _message_problem(m)
            if problem:
                return f"messages[{i}]: {problem}"
        return None
    for i, t in enumerate(prompt):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return (f"token ids must be integers >= 0, but item {i} is {t!r}" if not isinstance(t, dict) else
                    f"item {i} is a message but item 0 is not: a prompt is all messages or all token ids")
    return None


def _message_problem(m) -> Optional[str]:
    if not isinstance(m, dict):
        return f"a message is an object with role and content, not {type(m).__name__}"
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        return "no role (each message needs \"role\": system, user, assistant ...)" if role is None else \
            f"role must be text, not {type(role).__name__}"
    if content is None and not m.get("tool_calls"):
        return f"({role}) has no content"
    if content is not None and not isinstance(content, (str, list)):
        return f"({role}) content must be text (or a list of content parts), not {type(content).__name__}"
    return None


def encode_prompt(prompt: Prompt, tokenizer: Optional[Tokenizer], template: Optional[ChatTemplate],
                  tools: Optional[list] = None) -> list[int]:
    """Token ids of a prompt (`tools`: the tool list a conversation's template renders). A prompt that is not one, or a conversation the template refuses or
    fails on, raises InvalidRequest (a TemplateLimit, the template's own fault, passes as it is)."""
    problem = prompt_problem(prompt)
    if problem:
        raise InvalidRequest(problem)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("a text prompt needs a tokenizer (the checkpoint has no tokenizer.json); pass token "
                                 "ids instead")
        return _encode(tokenizer, prompt, True)
    if is_chat(prompt):
        if tokenizer is None or template is None:
            raise InvalidRequest("a chat conversation needs a tokenizer and a chat template (the tokenizer has none: "
                                 "pass chat_template, e.g. --chat-template chatml)")
        try:
            text = template.render(list(prompt), add_generation_prompt=True, tools=tools,
                                   special_tokens=tokenizer.special_tokens_map)
        except TemplateLimit:
            raise
        except TemplateRaised as e:
            raise InvalidRequest(f"the chat template {template.name} refuses this conversation: {e}") from None
        except Exception as e:  # jinja2 errors, and Python errors of the template's code (a missing key ...)
            raise InvalidRequest(f"the chat template {template.name} failed on this conversation: "
                                 f"{type(e).__name__}: {e}") from None
        return _encode(tokenizer, text, False)
    return [int(t) for t in prompt]


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL while it works (encode holds it: a long prompt tokenized in a server's
    # worker thread would stop its event loop); the ids are the same
    return tokenizer.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def end_of_turn_id(tokenizer: Tokenizer, template: ChatTemplate) -> Optional[int]:
    """The first special token the template writes after an assistant message's text, if any."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = template.render(msgs, special_tokens=tokenizer.special_tokens_map)
    except TemplateLimit:
        raise
    except Exception:  # refuses or fails on the probe (raise_exception, a key it needs): no end-of-turn found
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    for tid in tokenizer.tok.encode(text[at + len(_PROBE):], add_special_tokens=False).ids:
        if tid in tokenizer.special_ids:
            return tid
    return None
