"""response_format through the official openai client: json_schema and json_object answers for chat and
text completions, whole and streamed, at temperature 1 on a random model; 400s naming response_format;
the /metrics counters of constrained requests and grammar errors."""

import json

import pytest
from test_health_metrics import scrape, value

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["mood", "count", "tags"],
          "properties": {"mood": {"enum": ["good", "fine", "bad"]},
                         "count": {"type": "integer", "minimum": 1, "maximum": 20},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA, "strict": True}}
CHAT = [{"role": "user", "content": "hello how are you"}]


def check(text: str) -> dict:
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # a hand check of SCHEMA
        assert set(value) == {"mood", "count", "tags"} and value["mood"] in ("good", "fine", "bad")
        assert type(value["count"]) is int and 1 <= value["count"] <= 20
        assert len(value["tags"]) <= 2 and all(isinstance(t, str) and len(t) <= 5 for t in value["tags"])
    else:
        jsonschema.validate(value, SCHEMA)
    return value


def test_chat_json_schema_answers_validate(client, serve_checkpoint):
    r = client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, n=6, temperature=1.0, seed=7,
                                       max_tokens=150, response_format=FORMAT)
    assert len(r.choices) == 6
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        check(c.message.content)
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not one forced answer


def test_streamed_json_schema_answer_validates(client, serve_checkpoint):
    for seed in range(3):
        chunks = list(client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, temperature=1.0,
                                                     seed=seed, max_tokens=150, response_format=FORMAT, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        check(text)


def test_completions_json_object(client, serve_checkpoint):
    r = client.completions.create(model=str(serve_checkpoint), prompt="the quick brown fox", temperature=1.0, n=3,
                                  seed=1, max_tokens=150, extra_body={"response_format": {"type": "json_schema",
                                                                                          "json_schema": FORMAT["json_schema"]}})
    for c in r.choices:
        check(c.text)
    r = client.completions.create(model=str(serve_checkpoint), prompt="hello", temperature=0.0, max_tokens=60,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("fmt,words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}, "frobnicate"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}, "nope"),
    ({"type": "yaml"}, "yaml"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name"),
])
def test_schema_the_engine_cannot_compile_is_a_400(client, serve_checkpoint, server, fmt, words):
    before = scrape(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, max_tokens=5, response_format=fmt)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "response_format" and words in err["message"], err
    assert value(scrape(server), "astrai_grammar_errors_total") - value(before, "astrai_grammar_errors_total") == 1


def test_metrics_count_constrained_requests(client, serve_checkpoint, server):
    before = scrape(server)
    client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, max_tokens=40, seed=2,
                                   response_format=FORMAT)
    client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, max_tokens=40, seed=2,
                                   response_format={"type": "json_object"})
    client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, max_tokens=4,
                                   response_format={"type": "text"})
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("astrai_constrained_requests_total", kind="json_schema") == 1
    assert delta("astrai_constrained_requests_total", kind="json_object") == 1
    assert delta("astrai_constrained_requests_total", kind="tool_call") == 0
    assert value(after, "astrai_grammar_failures_total") == 0
