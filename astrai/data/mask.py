"""Exact loss masks for rendered chat templates, in linear time.

The problem: which characters of a rendered conversation are a message's own text (content or
reasoning), as opposed to template scaffolding (role headers, default system prompts, dates)?
Searching for token ids is wrong (the same text tokenizes differently in context), and rendering
each message alone or each prefix again is wrong for stateful templates and O(T^2).

The method (two renders, one tokenization, all linear in the conversation):

1. Render the conversation once: `text`. This is exactly what apply_chat_template returns, and
   the only string that is tokenized.
2. Render it a second time with every message's text replaced by a unique sentinel (a private-use
   character pair around an index). Content holding `<think>`/`</think>` tags is split at the tags
   so templates that move reasoning around (Qwen3/DeepSeek-R1 style) see the same structure.
   Whatever lies between sentinels in that `skeleton` is template scaffolding.
3. Walk `text` with a cursor against the skeleton: each scaffold piece must match exactly at the
   cursor, and each sentinel must be followed by its message text (as the template emitted it:
   verbatim or trimmed) followed by the next scaffold piece. Any mismatch means the template
   treats content in a way we cannot verify, and the record is rejected with that reason.
4. A trained message's region runs from the end of the assistant header (the template's
   generation prompt, found in the scaffold just before the message) to the end of its last text
   span, so generated markup such as `<think>` and `</think>` is trained; role headers are not.
   The end-of-turn token(s) right after the region (whitespace, then the first special token) are
   trained or masked by policy.
5. Tokenize `text` once with character offsets. A token is trained iff its span lies inside a
   trained region. A token that straddles a region edge (template text and message text merged in
   one token) cannot be attributed, and the record is rejected with that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from astrai.data.errors import RecordError
from astrai.data.template import REASONING_FIELDS, TemplateRaised

IGNORE = -100
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_THINK_RE = re.compile(r"(\s*</?think>\s*)")


@dataclass
class Region:
    start: int  # character offsets into the rendered text
    end: int
    msg: int  # message index
    role: str
    trained: bool


@dataclass
class RenderedChat:
    text: str
    regions: list[Region]  # one per message that the template emitted, in text order
    text_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, msg) of message texts


def _sentinel(k: int) -> str:
    return f"\ue000{k}\ue001"


def _split_for_sentinels(value: str) -> list[tuple[bool, str]]:
    """[(is_text, piece)]: text pieces get sentinels; think tags (with their whitespace) stay literal."""
    if "<think>" not in value and "</think>" not in value:
        return [(True, value)]
    out = []
    for i, piece in enumerate(_THINK_RE.split(value)):
        if i % 2:
            out.append((False, piece))
        elif piece:
            out.append((True, piece))
    return out


def render_with_regions(template, messages: list[dict], trained: list[bool], *, add_generation_prompt=False,
                        tools=None, special_tokens=None, template_kwargs=None, gen_prompt: str = "") -> RenderedChat:
    kwargs = dict(template_kwargs or {})
    try:
        text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               special_tokens=special_tokens, **kwargs)
    except TemplateRaised as e:
        raise RecordError("template_error", f"the chat template raised: {e}") from None
    except Exception as e:  # a template bug (e.g. undefined attribute) is reported per record
        raise RecordError("template_error", f"the chat template failed: {type(e).__name__}: {e}") from None

    if "\ue000" in text or any("\ue000" in str(m.get("content", "")) for m in messages):
        raise RecordError("span_unverified", "the text contains U+E000, which astrai reserves for span markers")

    # Skeleton render: message texts replaced by sentinels.
    pieces: list[tuple[int, str]] = []  # sentinel k -> (msg index, original text)
    skel_msgs = []
    for i, m in enumerate(messages):
        m2 = dict(m)
        for key in ("content",) + REASONING_FIELDS:
            v = m.get(key)
            if isinstance(v, str):
                parts = []
                for is_text, piece in _split_for_sentinels(v):
                    if is_text:
                        parts.append(_sentinel(len(pieces)))
                        pieces.append((i, piece))
                    else:
                        parts.append(piece)
                m2[key] = "".join(parts)
        skel_msgs.append(m2)
    try:
        skeleton = template.render(skel_msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                                   special_tokens=special_tokens, **kwargs)
    except Exception as e:
        raise RecordError("span_unverified", f"the template fails when message texts are replaced by markers "
                                             f"({type(e).__name__}: {e}); its output depends on message text") from None

    spans = _walk(text, skeleton, pieces)
    return RenderedChat(text, _regions(text, spans, messages, trained, gen_prompt), spans)


def _candidates(v: str):
    seen = set()
    for c in (v, v.strip(), v.lstrip(), v.rstrip(), v.strip("\n"), v.strip(" ")):
        if c not in seen:
            seen.add(c)
            yield c


def _walk(text: str, skeleton: str, pieces: list[tuple[int, str]]) -> list[tuple[int, int, int]]:
    """Match skeleton against text; return (start, end, msg) per emitted message text, in text order."""
    marks = list(_SENTINEL_RE.finditer(skeleton))
    used = set()
    scaffolds = []
    prev = 0
    for m in marks:
        scaffolds.append(skeleton[prev:m.start()])
        prev = m.end()
    scaffolds.append(skeleton[prev:])
    cursor = 0
    spans = []
    for j, m in enumerate(marks):
        k = int(m.group(1))
        if k in used:
            raise RecordError("span_unverified", f"the template emits message {pieces[k][0]}'s text twice")
        used.add(k)
        scaffold = scaffolds[j]
        if not text.startswith(scaffold, cursor):
            raise _mismatch(text, cursor, scaffold, pieces[k][0])
        cursor += len(scaffold)
        after = scaffolds[j + 1]
        is_last = j + 1 == len(marks)
        for cand in _candidates(pieces[k][1]):
            end = cursor + len(cand)
            if text.startswith(cand, cursor) and (text.endswith(after) and end + len(after) == len(text)
                                                  if is_last else text.startswith(after, end)):
                spans.append((cursor, end, pieces[k][0]))
                cursor = end
                break
        else:
            raise RecordError("span_unverified", f"message {pieces[k][0]}: its text is not where the template "
                                                 f"puts it (the template changes message text in a way astrai "
                                                 f"cannot verify)")
    if not text.startswith(scaffolds[-1], cursor) or cursor + len(scaffolds[-1]) != len(text):
        raise _mismatch(text, cursor, scaffolds[-1], None)
    return spans


def _mismatch(text, cursor, scaffold, msg) -> RecordError:
    near = f" near message {msg}" if msg is not None else " at the end"
    return RecordError("span_unverified", f"template output{near} depends on message text (rendered "
                                          f"{text[cursor:cursor + 40]!r}, expected {scaffold[:40]!r})")


def _regions(text, spans, messages, trained, gen_prompt) -> list[Region]:
    by_msg: dict[int, list[tuple[int, int]]] = {}
    for s, e, i in spans:
        by_msg.setdefault(i, []).append((s, e))
    regions = []
    prev_end = 0
    for i in sorted(by_msg, key=lambda i: by_msg[i][0][0]):
        ss = by_msg[i]
        start, end = ss[0][0], ss[-1][1]
        role = str(messages[i].get("role"))
        if trained[i] and gen_prompt:
            # Train from the end of the assistant header: generated markup (e.g. "<think>\n") counts.
            at = text.rfind(gen_prompt, prev_end, start)
            if at >= 0:
                start = at + len(gen_prompt)
        regions.append(Region(start, end, i, role, trained[i]))
        prev_end = end
    return regions


def label_tokens(chat: RenderedChat, ids: np.ndarray, offsets: np.ndarray, special_ids: frozenset,
                 end_of_turn: str) -> np.ndarray:
    """Labels for the tokens of chat.text (ids with their (start, end) character offsets)."""
    n = len(ids)
    labels = np.full(n, IGNORE, dtype=np.int32)
    if n == 0:
        return labels
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = chat.text
    for r in chat.regions:
        if not r.trained:
            continue
        for edge in (r.start, r.end):
            j = int(np.searchsorted(starts, edge, side="right")) - 1
            if j >= 0 and starts[j] < edge < ends[j]:
                raise RecordError("boundary_straddle", f"message {r.msg} ({r.role}): token {text[starts[j]:ends[j]]!r} "
                                                       f"spans template text and message text; no exact label exists")
        lo = int(np.searchsorted(starts, r.start, side="left"))
        hi = int(np.searchsorted(ends, r.end, side="right"))
        # tokens [lo, hi) lie inside the region (offsets are monotonic for one encode)
        labels[lo:hi] = ids[lo:hi]
        if end_of_turn == "train":
            k = hi
            while k < n and ids[k] not in special_ids and not text[starts[k]:ends[k]].strip():
                k += 1
            if k < n and ids[k] in special_ids:
                labels[hi:k + 1] = ids[hi:k + 1]
            else:
                raise RecordError("no_end_of_turn", f"message {r.msg} ({r.role}) is trained but no special "
                                                    f"end-of-turn token follows it; set end_of_turn: mask, or add "
                                                    f"the template's end token to added_tokens")
    return labels


def message_of_tokens(chat: RenderedChat, offsets: np.ndarray) -> np.ndarray:
    """Message index per token (-1 for template scaffolding), for stats and inspect."""
    out = np.full(len(offsets), -1, dtype=np.int32)
    if not len(offsets):
        return out
    starts, ends = offsets[:, 0], offsets[:, 1]
    for s, e, i in chat.text_spans:
        lo = int(np.searchsorted(starts, s, side="left"))
        hi = int(np.searchsorted(ends, e, side="right"))
        out[lo:hi] = i
    return out


def generation_prompt(template, special_tokens=None, template_kwargs=None) -> str:
    """The text add_generation_prompt appends (e.g. '<|im_start|>assistant\\n'); '' if none or unknown."""
    probe = [{"role": "user", "content": "x"}]
    try:
        a = template.render(probe, add_generation_prompt=False, special_tokens=special_tokens, **(template_kwargs or {}))
        b = template.render(probe, add_generation_prompt=True, special_tokens=special_tokens, **(template_kwargs or {}))
    except Exception:
        return ""
    return b[len(a):] if b.startswith(a) else ""
