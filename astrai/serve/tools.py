"""Tool calls: `tools` rendered by the chat template, calls parsed back from the answer, forced calls.

The format is the one the chat template writes (so the one the model was trained on), found in the
template's source:
    hermes    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Hermes,
              Qwen2.5/Qwen3, astrai's bundled `qwen` template)
    llama3    {"name": ..., "parameters": {...}} as the whole answer, after an optional <|python_tag|>
              (Llama 3.1+ JSON tool calling, astrai's bundled `llama3` template); calls joined by ";"
    mistral   [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3), or name[ARGS]{...} per call (v11)
A template that never reads `tools` (ChatML, SmolLM2's own) cannot show them to the model: a request
with tools is then a 400 naming `tools`, never a silent prompt without them.

An answer that holds calls in the format becomes OpenAI's `message.tool_calls` (arguments as a JSON
string, an id per call) with finish_reason "tool_calls", and the text before the first call as
`content` (null when empty); an answer whose calls do not parse (bad JSON, no name) stays plain
content. `tool_choice` "required" or a named function holds the answer to the grammar of one call
in the format (astrai.infer.grammar), arguments valid against the function's `parameters` schema.
Messages sent back (assistant messages with `tool_calls`, `role: "tool"` with `tool_call_id`) reach
the template as the data pipeline gives them: arguments as an object (a JSON string from an OpenAI
client is parsed), so a conversation renders the same in training and in serving.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from astrai.serve.protocol import APIError

FORMATS = ("hermes", "llama3", "mistral")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def tool_format(template) -> Optional[str]:
    """The tool-call format the chat template writes, or None when it renders no tools (or none astrai parses)."""
    if template is None or not template.reads("tools"):
        return None
    src = template.source
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "ipython" in src or "<|python_tag|>" in src:
        return "llama3"
    return None


def check_tools(req, template) -> Optional[str]:
    """The format of a request with tools (None without); 400 naming tools or tool_choice otherwise."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    for i, t in enumerate(req.tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                f"\"description\", \"parameters\"}}}}", param="tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    fmt = tool_format(template)
    if fmt is None:
        name = template.name if template is not None else "none"
        why = ("does not render tools" if template is None or not template.reads("tools") else
               "writes tool calls in a format astrai does not parse (hermes <tool_call>, llama3 JSON, mistral "
               "[TOOL_CALLS])")
        raise APIError(400, f"tools: the chat template {name} {why}; start the server with a template that "
                            f"does (--chat-template qwen or llama3)", param="tools")
    names = [t["function"]["name"] for t in req.tools]
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(f, dict) or f.get("name") not in names:
            raise APIError(400, f"tool_choice must name one of the tools ({', '.join(names)}): "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param="tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise APIError(400, f"tool_choice {choice!r}: use none, auto, required or a named function",
                       param="tool_choice")
    return fmt


def _call_schema(fmt: str, tool: dict) -> dict:
    f = tool["function"]
    key = "parameters" if fmt == "llama3" else "arguments"
    params = f.get("parameters") or {"type": "object"}
    return {"type": "object", "additionalProperties": False, "required": ["name", key],
            "properties": {"name": {"const": f["name"]}, key: params}}


def forced_call_lark(req, fmt: str, special) -> Optional[str]:
    """The Lark grammar (llguidance's, with %json) of one call of the tool `tool_choice` names, or of any of
    the tools for "required"; None when no call is forced. `special(text)`: the token id of a special token."""
    choice = req.tool_choice
    if choice == "required":
        tools = req.tools
    elif isinstance(choice, dict):
        tools = [t for t in req.tools if t["function"]["name"] == choice["function"]["name"]]
    else:
        return None
    schemas = [_call_schema(fmt, t) for t in tools]
    schema = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_STYLE}
    call = "%json " + json.dumps(schema)
    if fmt == "hermes":
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}'
    if fmt == "llama3":
        return f"start: call\ncall: {call}"
    tag = special("[TOOL_CALLS]")
    head = f"<[{tag}]>" if tag is not None else '"[TOOL_CALLS]"'
    return f'start: {head} "[" call "]"\ncall: {call}'


def _decode_all(text: str) -> list:
    """Consecutive JSON values in `text`, separated by whitespace or ";" (ValueError otherwise)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        value, i = dec.raw_decode(text, i)
        out.append(value)


def _call(obj: Any, key: str = "arguments") -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call needs a name")
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments must be an object")
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_tool_calls(fmt: str, text: str) -> tuple[Optional[str], list[dict]]:
    """(content, calls) of an answer: calls as {"name", "arguments" (a JSON string)}; no calls when none
    parse, and then the content is the whole text."""
    try:
        if fmt == "hermes":
            at = text.find("<tool_call>")
            if at < 0:
                return text, []
            calls = [_call(json.loads(m.group(1))) for m in _HERMES.finditer(text, at)]
            return text[:at].strip() or None, calls
        if fmt == "llama3":
            body = text.strip().removeprefix("<|python_tag|>").strip()
            if not body.startswith("{"):
                return text, []
            return None, [_call(v, "parameters") for v in _decode_all(body)]
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        rest = text[at + len("[TOOL_CALLS]"):].strip()
        if rest.startswith("["):
            calls = [_call(v) for v in json.loads(rest)]
        else:
            calls, dec, i = [], json.JSONDecoder(), 0
            while (m := _MISTRAL_V11.match(rest, i)) is not None:
                args, i = dec.raw_decode(rest, m.end())
                calls.append(_call({"name": m.group(1), "arguments": args}))
            if not calls or rest[i:].strip():
                raise ValueError("not name[ARGS]{...}")
        return text[:at].strip() or None, calls
    except (ValueError, TypeError, AttributeError):
        return text, []


def answer_calls(fmt: str, completion, tokenizer) -> tuple[Optional[str], list[dict]]:
    """(content, OpenAI tool_calls) of a finished choice. Parsed from its tokens decoded with special tokens
    kept (Mistral's [TOOL_CALLS] is one), less the stop token that ended it."""
    ids = list(completion.token_ids)
    if isinstance(completion.stop_reason, int) and ids and ids[-1] == completion.stop_reason:
        ids = ids[:-1]
    raw = tokenizer.tok.decode(ids, skip_special_tokens=False) if isinstance(completion.stop_reason, (int, type(None))) \
        else completion.text
    content, calls = parse_tool_calls(fmt, raw)
    if not calls:
        return completion.text, []
    return content, openai_tool_calls(calls)


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


class HeldText:
    """A streamed answer's text with everything from the first possible tool call on held back, so a call is
    never streamed as content (it goes out as tool_calls deltas when the answer ends)."""

    MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",)}
    OPENERS = {"hermes": "", "llama3": "{", "mistral": "["}  # a call that starts the answer

    def __init__(self, fmt: str):
        self.fmt, self.seen, self.sent, self.holding = fmt, "", 0, False

    def push(self, text: str) -> str:
        """The part of the text so far that is certainly content and was not released yet."""
        self.seen += text
        if self.holding:
            return ""
        opener = self.OPENERS[self.fmt]
        if opener and self.seen.lstrip().startswith(opener):
            self.holding = True
            return ""
        cut = len(self.seen)
        for m in self.MARKERS[self.fmt]:
            at = self.seen.find(m)
            if at >= 0:
                self.holding, cut = True, min(cut, at)
            else:  # the end of the text may be the start of a marker
                for k in range(min(len(m) - 1, len(self.seen)), 0, -1):
                    if self.seen.endswith(m[:k]):
                        cut = min(cut, len(self.seen) - k)
                        break
        if opener and not self.seen.strip():
            cut = 0  # only whitespace so far: the answer may still open with a call
        out = self.seen[self.sent:cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return out

    def rest(self) -> str:
        """At the end, when the held text held no call: what is still to be sent as content."""
        out = self.seen[self.sent:]
        self.sent = len(self.seen)
        return out


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with `function.arguments` as an object (OpenAI clients send a JSON string; chat
    templates and training data hold an object)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                f = c.get("function") if isinstance(c, dict) else None
                if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                    try:
                        args = json.loads(f["arguments"])
                    except ValueError:
                        args = None
                    if isinstance(args, dict):
                        c = {**c, "function": {**f, "arguments": args}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
