"""Where each message sits in a rendered conversation: the render-twice walk of astrai.data.mask.

`render_with_regions` renders the conversation once as it is tokenized and once with every message
text replaced by a sentinel, walks the two together, and returns the text plus one `Region` per
message (character span, role, trained, and for tool calls how far the turn runs). Anything it
cannot verify raises a RecordError with the reason. The algorithm is described in the docstring
of astrai.data.mask, which turns regions into token labels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from astrai.errors import RecordError
from astrai.text.sandbox import MAX_VALUE, weight
from astrai.text.template import REASONING_FIELDS, TemplateLimit, TemplateRaised

_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_THINK_RE = re.compile(r"(\s*</?think>\s*)")


@dataclass
class Region:
    start: int  # character offsets into the rendered text
    end: int
    msg: int  # message index
    role: str
    trained: bool
    to_eot: bool = False  # the message's output continues after `end` (tool calls) up to the end-of-turn token
    next_text_start: int = -1  # to_eot: where the next message's text starts (bounds the search); -1: end of text
    tool_call_strings: tuple = ()  # to_eot: the strings inside the message's tool calls (see label_tokens)


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
                        tools=None, special_tokens=None, template_kwargs=None, gen_prompt: str = "",
                        answer_lead: str = "") -> RenderedChat:
    kwargs = dict(template_kwargs or {})
    try:
        text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               special_tokens=special_tokens, **kwargs)
    except TemplateRaised as e:
        raise RecordError("template_error", f"the chat template raised: {e}") from None
    except TemplateLimit as e:  # a template past its size or time bounds is at fault, not the record: stop the run,
        if weight(messages) > MAX_VALUE:  # unless the record's own text is more than any rendered value may hold
            raise RecordError("too_large", f"the messages hold more than the {MAX_VALUE:,} characters a chat "
                                           f"template may render in one value ({e})") from None
        raise
    except Exception as e:  # a template bug (e.g. undefined attribute) is reported per record
        raise RecordError("template_error", f"the chat template failed: {type(e).__name__}: {e}") from None

    if "\ue000" in text or any("\ue000" in str(m.get("content", "")) for m in messages):
        raise RecordError("span_unverified", "the text contains U+E000, which astrai reserves for span markers")

    # Skeleton render: message texts replaced by sentinels.
    pieces: list[tuple[int, str]] = []  # sentinel k -> (msg index, original text)
    with_content: set[int] = set()  # messages whose content got a sentinel (holds text besides think tags)
    edges: dict[int, list[str]] = {}  # sentinel k -> [literal think tags before it, after it] within its value
    skel_msgs = []
    for i, m in enumerate(messages):
        m2 = dict(m)
        for key in ("content",) + REASONING_FIELDS:
            v = m.get(key)
            # "" keeps no sentinel: a template testing `if message.content` must see the same thing twice
            if isinstance(v, str) and v:
                parts, first, literal = [], None, ""
                for is_text, piece in _split_for_sentinels(v):
                    if is_text:
                        k = len(pieces)
                        if first is None:
                            first = k
                            edges[k] = [literal, ""]
                        else:
                            edges[k] = ["", ""]
                        literal = ""
                        parts.append(_sentinel(k))
                        pieces.append((i, piece))
                        if key == "content":
                            with_content.add(i)
                    else:
                        literal += piece
                        parts.append(piece)
                if first is not None:
                    edges[len(pieces) - 1][1] = literal
                m2[key] = "".join(parts)
        skel_msgs.append(m2)
    try:
        skeleton = template.render(skel_msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                                   special_tokens=special_tokens, **kwargs)
    except TemplateLimit:
        raise
    except Exception as e:
        raise RecordError("span_unverified", f"the template fails when message texts are replaced by markers "
                                             f"({type(e).__name__}: {e}); its output depends on message text") from None

    spans = _walk(text, skeleton, pieces)
    regions = _regions(text, spans, messages, trained, gen_prompt, edges, add_generation_prompt, with_content,
                       answer_lead)
    return RenderedChat(text, regions, [(s, e, i) for s, e, i, _ in spans])


def _candidates(v: str):
    seen = set()
    for c in (v, v.strip(), v.lstrip(), v.rstrip(), v.strip("\n"), v.strip(" "), v.lstrip("\n"), v.rstrip("\n")):
        if c not in seen:
            seen.add(c)
            yield c


def _walk(text: str, skeleton: str, pieces: list[tuple[int, str]]) -> list[tuple[int, int, int, int]]:
    """Match skeleton against text; return (start, end, msg, sentinel k) per emitted message text, in text order."""
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
                spans.append((cursor, end, pieces[k][0], k))
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


def _regions(text, spans, messages, trained, gen_prompt, edges, add_generation_prompt=False,
             with_content=None, answer_lead: str = "") -> list[Region]:
    by_msg: dict[int, list[tuple[int, int, int]]] = {}
    for s, e, i, k in spans:
        by_msg.setdefault(i, []).append((s, e, k))
    order = sorted(by_msg, key=lambda i: by_msg[i][0][0])
    starts = [by_msg[i][0][0] for i in order]  # where each emitted message's text begins, in text order
    regions = []
    prev_end = 0
    for n, i in enumerate(order):
        ss = by_msg[i]
        start, end = ss[0][0], ss[-1][1]
        limit = starts[n + 1] if n + 1 < len(order) else len(text)
        # Think tags that open/close the message's own text are the message's, not template text
        # (needed when there is no generation prompt to start from, e.g. [INST] templates). A
        # template that trims the content also trims their outer whitespace.
        lead, tail = edges[ss[0][2]][0], edges[ss[-1][2]][1]
        for cand in dict.fromkeys((lead, lead.lstrip(), lead.lstrip("\n"))) if lead else ():
            if cand and start - len(cand) >= prev_end and text.startswith(cand, start - len(cand)):
                start -= len(cand)
                break
        for cand in dict.fromkeys((tail, tail.rstrip(), tail.rstrip("\n"))) if tail else ():
            if cand and end + len(cand) <= limit and text.startswith(cand, end):
                end += len(cand)
                break
        role = str(messages[i].get("role"))
        if trained[i] and role == "assistant":
            # Train from the end of the assistant header: generated markup (e.g. "<think>\n") counts.
            # Only for assistant messages: the generation prompt is the assistant header, and for a
            # trained user message it could be the header of an empty assistant turn before it.
            at = text.rfind(gen_prompt, prev_end, start) if gen_prompt else -1
            if at >= 0:
                start = at + len(gen_prompt)
            elif answer_lead and start - len(answer_lead) >= prev_end and \
                    text.startswith(answer_lead, start - len(answer_lead)):
                # No generation prompt to find (Llama-2 style: the prompt ends at "[/INST]"): the prompt
                # ends `answer_lead` before the text; the model generates the lead (" ") itself, merged
                # into the answer's first token (" Creating"), so the lead is trained too.
                start -= len(answer_lead)
        calls = messages[i].get("tool_calls")
        # Output the template renders after the last text span runs to the end-of-turn token: tool calls,
        # and, when the content left no text (empty, or think tags only) but the reasoning did, the
        # markup closing the reasoning ("\n</think>\n\n"), which would otherwise go untrained.
        to_eot = bool(calls) or (with_content is not None and i not in with_content)
        regions.append(Region(start, end, i, role, trained[i], to_eot, limit, _strings(calls)))
        prev_end = end
    regions += _textless_regions(text, by_msg, messages, trained, gen_prompt, add_generation_prompt, answer_lead)
    regions.sort(key=lambda r: r.start)
    return regions


def _textless_regions(text, by_msg, messages, trained, gen_prompt, add_generation_prompt=False,
                      answer_lead: str = "") -> list[Region]:
    """Regions for trained messages that emitted no text (empty content, tool calls only).

    Consecutive messages without text form a gap between two messages with text. Each assistant
    message in the gap owns one generation prompt (its header) there, in order; the next message
    with text owns one more if it is an assistant (or, at the end, the generation prompt itself). A
    trained message is anchored at its own header and its output runs to the end-of-turn token
    (to_eot), never past the next header. If the headers in the gap cannot be counted off exactly
    this way (a template that skips an empty message, header text inside tool-call data), which
    header is whose is unknown and the record is rejected: taking the first one found trained an
    untrained message's tool call when two assistant messages without text were adjacent.
    """
    out = []
    cursor, i, n = 0, 0, len(messages)
    while i < n:
        if i in by_msg:
            cursor = max(cursor, by_msg[i][-1][1])
            i += 1
            continue
        j = i
        while j < n and j not in by_msg:
            j += 1
        limit = by_msg[j][0][0] if j < n else len(text)
        if any(trained[k] for k in range(i, j)) and not gen_prompt and _literal_gap(range(i, j), messages, trained):
            out += _locate_literals(text, range(i, j), cursor, limit, messages, trained, answer_lead)
        elif any(trained[k] for k in range(i, j)):
            out += _anchor_gap(text, range(i, j), cursor, limit, messages, trained, gen_prompt,
                               messages[j].get("role") == "assistant" if j < n else add_generation_prompt)
        i = j
    return out


def _literal_gap(gap, messages, trained) -> bool:
    """Every trained message of the gap is an assistant whose content is only think tags (literal text,
    no sentinel) and has no tool calls: its output is that literal text, found where it is rendered."""
    return all(messages[k].get("role") == "assistant" and isinstance(messages[k].get("content"), str)
               and messages[k]["content"].strip() and not messages[k].get("tool_calls")
               for k in gap if trained[k])


def _locate_literals(text, gap, cursor, limit, messages, trained, answer_lead) -> list[Region]:
    """Templates without a generation prompt give no header to anchor at (Mistral, Llama-2): a trained
    answer made only of think tags is located by its own text, which must occur exactly once between
    the messages around the gap (else which occurrence is whose is unknown: rejected)."""
    out = []
    for k in gap:
        if not trained[k]:
            continue
        content = messages[k]["content"]
        for cand in _candidates(content):
            at = text.find(cand, cursor, limit) if cand else -1
            if at >= 0:
                break
        if at < 0 or text.find(cand, at + 1, limit) >= 0:
            raise RecordError("span_unverified", f"message {k} (assistant) holds only think tags and the template "
                                                 f"has no generation prompt; its text is not found exactly once "
                                                 f"where it is rendered, so its output cannot be located")
        start = at
        lead_at = start - len(answer_lead)
        if answer_lead and lead_at >= cursor and text.startswith(answer_lead, lead_at):
            start = lead_at
        out.append(Region(start, at + len(cand), k, "assistant", True, False, limit))
        cursor = at + len(cand)
    return out


def _anchor_gap(text, gap, cursor, limit, messages, trained, gen_prompt, next_has_header) -> list[Region]:
    heads = [k for k in gap if messages[k].get("role") == "assistant"]
    found = []
    if gen_prompt and cursor <= limit:
        at = text.find(gen_prompt, cursor, limit)
        while at >= 0:
            found.append(at)
            at = text.find(gen_prompt, at + len(gen_prompt), limit)
    for k in gap:
        if not trained[k]:
            continue
        role = messages[k].get("role")
        # the generation prompt is the assistant header; other roles have no header to anchor at
        if role != "assistant" or not found:
            raise RecordError("span_unverified", f"message {k} ({role}) is trained but has no text in the "
                                                 f"render and no assistant header was found for it, so its output "
                                                 f"cannot be located")
        if len(found) != len(heads) + bool(next_has_header):
            raise RecordError("span_unverified", f"message {k} ({role}) is trained but has no text in the render, "
                                                 f"and the {len(found)} assistant header(s) before the next message "
                                                 f"do not match the {len(heads)} assistant message(s) without text "
                                                 f"there, so its output cannot be located")
    out = []
    for h, k in enumerate(heads):
        if trained[k]:
            start = found[h] + len(gen_prompt)
            end_by = found[h + 1] if h + 1 < len(found) else limit  # its end-of-turn comes before the next header
            calls = _strings(messages[k].get("tool_calls"))
            out.append(Region(start, start, k, "assistant", True, True, end_by, calls))
    return out


def _strings(value) -> tuple:
    """Every string (keys included) inside a tool-calls structure."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, dict):
        return tuple(s for k, v in value.items() for s in _strings(k) + _strings(v))
    if isinstance(value, (list, tuple)):
        return tuple(s for v in value for s in _strings(v))
    return ()


def prompt_probe(template, special_tokens=None, template_kwargs=None) -> tuple[str, str, str]:
    """(generation prompt, answer lead, after answer) of a template, from three renders of a probe.

    The generation prompt is the text add_generation_prompt appends (e.g. '<|im_start|>assistant\\n');
    '' if none or unknown. The answer lead is whitespace the template writes between the end of that
    prompt and an assistant answer: ' ' for Llama-2 style templates ('[/INST]' + ' ' + answer), ''
    for most. Only whitespace counts as a lead: anything else there would be a role header, which
    is never trained; and '' whenever the prompt is not a prefix of the conversation with the answer.
    After answer: what the template writes after an answer (its end-of-turn, e.g. '<|im_end|>\\n').
    """
    probe = [{"role": "user", "content": "x"}]
    marker = _sentinel(0)
    kwargs = template_kwargs or {}
    try:
        a = template.render(probe, add_generation_prompt=False, special_tokens=special_tokens, **kwargs)
        b = template.render(probe, add_generation_prompt=True, special_tokens=special_tokens, **kwargs)
        turn = template.render(probe + [{"role": "assistant", "content": marker}], add_generation_prompt=False,
                               special_tokens=special_tokens, **kwargs)
    except TemplateLimit:
        raise
    except Exception:
        return "", "", ""
    gen_prompt = b[len(a):] if b.startswith(a) else ""
    lead = ""
    if turn.startswith(b) and marker in turn[len(b):]:
        lead = turn[len(b):turn.index(marker, len(b))]
    after = turn[turn.index(marker) + len(marker):] if marker in turn else ""
    return gen_prompt, lead if not lead.strip() else "", after
