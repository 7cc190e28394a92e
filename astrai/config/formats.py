"""Input formats: how a chat record is laid out, declared apart from the template that renders it.

A pipeline reads its records either through `input.sections` (every key spelled out) or through
`input.format: NAME`, which stands for the one template section below; a recipe's preprocess stage
takes `format: NAME` to read other data with the same pipeline. Which template renders the
messages is the pipeline's `chat_template` (by default the model's own), never the format's.

| format | a record | the section it stands for |
|---|---|---|
| messages | {"messages": [{"role", "content"}, ...]} (OpenAI, transformers) | field: messages |
| sharegpt | {"conversations": [{"from": "human" \\| "gpt" \\| "system", "value"}, ...]} | field: conversations, message_keys {role: from, content: value}, roles {human: user, gpt: assistant} |
| alpaca | {"instruction", "input"?, "output", "system"?} | messages_from {system: system, user: [instruction, input], assistant: output} |
| prompt_completion | {"prompt": TEXT, "completion": TEXT} | messages_from {user: prompt, assistant: completion} |

Every one is `action: $role, template: true`: the mask rules decide what trains (by default the
assistant's answer and its end-of-turn token). `looks_like` names the format a record seems to be
in, so a record of one format fed to another says which key to set.
"""

from __future__ import annotations

from typing import Any, Optional

_CHAT = {"action": "$role", "template": True}
FORMATS: dict[str, dict] = {
    "messages": {"field": "messages", **_CHAT},
    "sharegpt": {"field": "conversations", **_CHAT, "message_keys": {"role": "from", "content": "value"},
                 "roles": {"human": "user", "gpt": "assistant"}},
    "alpaca": {**_CHAT, "messages_from": {"system": "system", "user": ["instruction", "input"], "assistant": "output"}},
    "prompt_completion": {**_CHAT, "messages_from": {"user": "prompt", "assistant": "completion"}},
}
FORMAT_NAMES = tuple(FORMATS)

# the keys that tell a format apart, checked in this order
_SIGNS = (("sharegpt", ("conversations",)), ("messages", ("messages",)), ("alpaca", ("instruction", "output")),
          ("prompt_completion", ("prompt", "completion")))


def format_section(name: str) -> dict:
    """The section `input.format: name` stands for (a fresh copy: callers may not share it)."""
    import copy

    return copy.deepcopy(FORMATS[name])


def looks_like(record: Any) -> Optional[str]:
    """The format whose keys the record has (None when it has none of them)."""
    if not isinstance(record, dict):
        return None
    return next((name for name, keys in _SIGNS if all(k in record for k in keys)), None)


def format_hint(record: Any, reading: Optional[str] = None) -> str:
    """What to set when a record is in another format than the one being read ('' when it is not)."""
    found = looks_like(record)
    if found is None or found == reading:
        return ""
    keys = ", ".join(f"'{k}'" for k in dict(_SIGNS)[found])
    return (f"; the record has {keys}: {found} data? set `format: {found}` (a recipe's preprocess stage) or "
            f"`input.format: {found}` (a pipeline)")
