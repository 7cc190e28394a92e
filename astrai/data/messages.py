"""A template section's messages read from a record: the one place where a record's fields become
the list of {role, content, ...} messages the chat template renders.

A record holds a conversation in one of three ways, each declared in the section:
- a list of messages under `field` ({role, content}, the chat format of OpenAI and transformers);
  a list of fields is joined into one conversation ([prompt, chosen]), all but the last field's
  messages being the prompt;
- the same list under other keys and role names, as ShareGPT writes it ({"from": "human",
  "value": ...}): `message_keys: {role: from, content: value}` names the keys and `roles: {human:
  user, gpt: assistant}` renames roles as they are read (a role not listed passes through, and
  is then checked against the mask rules like any other: a typo is still unknown_role). The
  message's other keys are kept; the record itself is never modified;
- plain fields, one message per role, in the order given: `messages_from: {system: system, user:
  [instruction, input], assistant: output}` (Alpaca). The fields of one role are joined by a blank
  line, as the Alpaca prompt sets its input apart from its instruction; a field that is missing,
  null or blank is left out, and a role left without text gets no message (an Alpaca record with
  no input is the instruction alone; one without system has no system message).

Every problem is a RecordError keyed by the user's own names (conversations[2].from).
"""

from __future__ import annotations

from astrai.config.formats import FORMATS, format_hint
from astrai.config.pipeline import Section
from astrai.errors import RecordError
from astrai.data.values import check_unicode, type_name
from astrai.text.template import REASONING_FIELDS

JOIN = "\n\n"  # between the fields of one role in messages_from


def section_fields(s: Section) -> list[str]:
    """The record fields a template section reads, in order."""
    if s.messages_from is not None:
        return [f for fs in s.messages_from.values() for f in ([fs] if isinstance(fs, str) else fs)]
    return [s.field] if isinstance(s.field, str) else list(s.field)


def read_messages(rec: dict, s: Section, mask_roles, any_role: bool) -> tuple[list[dict], int]:
    """The section's messages, and how many of them are prompt (from all fields but the last).
    `mask_roles`: the roles the mask rules know; any other is rejected unless `any_role`."""
    if s.messages_from is not None:
        msgs, n_prompt = _from_fields(rec, s), 0
    else:
        msgs, n_prompt = [], 0
        fields = section_fields(s)
        for fi, f in enumerate(fields):
            if fi == len(fields) - 1:
                n_prompt = len(msgs)
            msgs.extend(_message_list(rec, f, s, mask_roles, any_role))
    if not msgs:
        raise RecordError("empty_conversation", "the conversation has no messages" + _hint(rec, s),
                          key=section_fields(s)[0])
    return msgs, n_prompt


def _message_list(rec: dict, f: str, s: Section, mask_roles, any_role: bool) -> list[dict]:
    if f not in rec:
        raise RecordError("missing_field", "field is missing" + _hint(rec, s), key=f)
    v = rec[f]
    if isinstance(v, str):  # a bare string in a message list position: a user/assistant turn
        raise RecordError("wrong_type", "must be a list of messages ({role, content}), got a string", key=f)
    if not isinstance(v, list):
        raise RecordError("wrong_type", f"must be a list of messages, got {type_name(v)}", key=f)
    keys = s.message_keys or {}
    role_key, content_key = keys.get("role", "role"), keys.get("content", "content")
    renamed_keys = role_key != "role" or content_key != "content"
    out = []
    for i, m in enumerate(v):
        key = f"{f}[{i}]"
        if not isinstance(m, dict):
            raise RecordError("wrong_type", f"a message must be an object, got {type_name(m)}", key=key)
        role = m.get(role_key)
        if not isinstance(role, str):
            raise RecordError("missing_field" if role is None else "wrong_type",
                              f"a message needs a string '{role_key}'", key=f"{key}.{role_key}")
        mapped = s.roles.get(role, role)
        if mapped not in mask_roles and not any_role:
            read_as = f" (read as {mapped!r})" if mapped != role else ""
            fix = "add it to mask:, or map it in the section's roles:" if renamed_keys or s.roles else \
                "add it to mask: to allow it"
            raise RecordError("unknown_role", f"role {role!r}{read_as} is not one of {', '.join(mask_roles)} "
                                              f"(mask rules; {fix})", key=f"{key}.{role_key}")
        content = m.get(content_key)
        if content is None and not m.get("tool_calls"):
            raise RecordError("missing_field", f"a message needs '{content_key}'", key=f"{key}.{content_key}")
        if content is not None and not isinstance(content, str):
            raise RecordError("non_string_content", f"content must be a string, got {type_name(content)}",
                              key=f"{key}.{content_key}")
        for name in (content_key,) + REASONING_FIELDS:  # each text checked under the user's own key
            if isinstance(m.get(name), str):
                check_unicode(m[name], f"{key}.{name}")
        if s.mask_key is not None and s.mask_key in m and not isinstance(m[s.mask_key], bool):
            raise RecordError("wrong_type", f"must be true or false, got {type_name(m[s.mask_key])}",
                              key=f"{key}.{s.mask_key}")
        if renamed_keys:  # a new dict: the record itself stays as it came (rejects.jsonl writes it back)
            m = {k: x for k, x in m.items() if k not in (role_key, content_key)}
            m["role"], m["content"] = mapped, content
        elif mapped != role:
            m = dict(m, role=mapped)
        out.append(m)
    return out


def _hint(rec: dict, s: Section) -> str:
    """Which format to set when the record is in another one than the section reads."""
    reading = next((name for name, f in FORMATS.items() if Section(**f) == s), None)
    return format_hint(rec, reading)


def _from_fields(rec: dict, s: Section) -> list[dict]:
    """One message per role of messages_from (its roles are checked against the mask rules with the
    pipeline, not per record)."""
    msgs = []
    for role, fields in s.messages_from.items():
        texts = []
        for f in [fields] if isinstance(fields, str) else fields:
            v = rec.get(f)
            if v is None:
                continue
            if not isinstance(v, str):
                raise RecordError("wrong_type", f"must be a string, got {type_name(v)}", key=f)
            check_unicode(v, f)
            if v.strip():
                texts.append(v)
        if texts:
            msgs.append({"role": role, "content": JOIN.join(texts)})
    return msgs
