"""Tool calls: parsing hand-written answers of each format, the format read off each bundled template, and through
the official openai client: forced calls (required, named) whole and streamed, tool results sent back, a 400 for a
template without tools, and one conversation rendered the same by preprocessing and by the server."""

import json

import pytest
from serving import ServerProcess, assert_error

from astrai.serve.tools import HeldText, parse_tool_calls, tool_format
from astrai.text.template import resolve_template

openai = pytest.importorskip("openai")

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "hello how are you"}]


def args(call):
    return json.loads(call["arguments"])


@pytest.mark.parametrize("fmt,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}', None,
     [("get_weather", {"city": "Rome", "days": 1})]),
    ("llama3", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}', None,
     [("a", {}), ("b", {"x": [1]})]),
    ("mistral", 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', "Sure.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{}get_weather[ARGS]{"city": "Rome", "days": 5}', None,
     [("get_time", {}), ("get_weather", {"city": "Rome", "days": 5})]),
])
def test_parse_each_format(fmt, text, content, calls):
    got_content, got = parse_tool_calls(fmt, text)
    assert got_content == content
    assert [(c["name"], args(c)) for c in got] == calls


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "The weather is fine."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3", "{not json"),
    ("llama3", "Paris is sunny."),
    ("mistral", "[TOOL_CALLS] not a list"),
])
def test_answers_without_a_parseable_call_stay_content(fmt, text):
    assert parse_tool_calls(fmt, text) == (text, [])


@pytest.mark.parametrize("fmt,pieces,released", [
    ("hermes", ["Let me ", "check.\n<tool", "_call>\n{\"name\"", ": 1}"], "Let me check.\n"),
    ("hermes", ["It is <b>", "sunny</b>."], "It is <b>sunny</b>."),  # "<" that starts no call is released
    ("llama3", ["  ", '{"name"', ': "a"}'], ""),
    ("llama3", ["Paris ", "is {big}"], "Paris is {big}"),
])
def test_streamed_text_holds_back_what_may_be_a_call(fmt, pieces, released):
    h = HeldText(fmt)
    out = "".join(h.push(p) for p in pieces)
    if not h.holding:
        out += h.rest()
    assert out == released


@pytest.mark.parametrize("name,fmt", [("qwen", "hermes"), ("llama3", "llama3"), ("chatml", None), ("mistral", None)])
def test_format_of_the_bundled_templates(name, fmt):
    assert tool_format(resolve_template(name)) == fmt


@pytest.fixture(scope="module")
def qwen_server(serve_checkpoint):
    s = ServerProcess(serve_checkpoint, "--chat-template", "qwen", "--page-size", "4", "--kv-cache-tokens", "8192")
    yield s
    assert s.stop() == 0, "".join(s.stderr)[-3000:]


@pytest.fixture
def qclient(qwen_server):
    return openai.OpenAI(base_url=qwen_server.base, api_key="x", max_retries=0, timeout=120)


def valid_weather(call) -> None:
    a = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and a["city"] in ("Paris", "Rome") and 1 <= a["days"] <= 7, a
    assert set(a) == {"city", "days"} and type(a["days"]) is int


def test_named_tool_choice_forces_a_valid_call(qclient, serve_checkpoint, qwen_server):
    from test_health_metrics import scrape, value

    before = value(scrape(qwen_server), "astrai_constrained_requests_total", kind="tool_call")
    r = qclient.chat.completions.create(model=str(serve_checkpoint), messages=ASK, tools=TOOLS, n=4, seed=3,
                                        temperature=1.0, max_tokens=120,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        assert c.message.tool_calls[0].id.startswith("call_") and c.message.tool_calls[0].type == "function"
        valid_weather(c.message.tool_calls[0])
    assert value(scrape(qwen_server), "astrai_constrained_requests_total", kind="tool_call") - before == 1


def test_required_tool_choice_streams_tool_call_deltas(qclient, serve_checkpoint):
    chunks = list(qclient.chat.completions.create(model=str(serve_checkpoint), messages=ASK, tools=TOOLS, seed=5,
                                                  temperature=1.0, max_tokens=120, tool_choice="required",
                                                  stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name in ("get_weather", "get_time")
    if deltas[0].function.name == "get_weather":
        valid_weather(deltas[0])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_are_accepted_back(qclient, serve_checkpoint):
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = qclient.chat.completions.create(model=str(serve_checkpoint), messages=msgs, tools=TOOLS, max_tokens=5,
                                        temperature=0.0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason in ("length", "tool_calls") and r.usage.prompt_tokens > 0


def test_tools_with_a_template_that_does_not_render_them_is_a_400(server):
    """The shared server renders with ChatML, which never reads `tools`."""
    status, body = server.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert_error(status, body, 400, "tools", "does not render tools")


@pytest.mark.parametrize("extra,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "get_weather"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools", "frob"),
])
def test_bad_tools_are_400(qwen_server, extra, param, words):
    status, body = qwen_server.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra})
    assert_error(status, body, 400, param, words)


def test_a_tool_conversation_renders_the_same_in_preprocessing_and_serving(serve_checkpoint, qclient):
    """The record's trained final answer starts where the server's prompt for the same conversation ends."""
    from astrai.config import Pipeline
    from astrai.data.process import Processor
    from astrai.infer.engine import Engine, EngineOptions
    from astrai.serve.protocol import ChatRequest, parse
    from astrai.serve.tools import arguments_as_objects
    from astrai.text.tokenizer import load_tokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "days": 2}}}
    data = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                  {"role": "assistant", "content": "It is sunny in Paris."}]
    pipe = Pipeline.model_validate({"version": 1, "chat_template": "qwen", "input": {
        "tools_field": "tools", "sections": [{"field": "messages", "action": "$role", "template": True}]}})
    seq = Processor(pipe, load_tokenizer(str(serve_checkpoint))).process_one({"messages": data, "tools": TOOLS}).seq()
    labels = list(seq.labels)
    start = max(i for i in range(1, len(labels)) if labels[i] != -100 and labels[i - 1] == -100)
    trained_prefix = [int(t) for t in seq.input_ids[:start]]

    # what a client sends: arguments as a JSON string, content null
    sent = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = parse(ChatRequest, json.dumps({"messages": sent, "tools": TOOLS}).encode())
    engine = Engine.from_checkpoint(serve_checkpoint, EngineOptions(device="cpu", dtype="float32", chat_template="qwen",
                                                                     kv_cache_tokens=1024))
    assert engine.encode(arguments_as_objects(req.conversation()), TOOLS) == trained_prefix
    r = qclient.chat.completions.create(model=str(serve_checkpoint), messages=sent, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens == len(trained_prefix)
