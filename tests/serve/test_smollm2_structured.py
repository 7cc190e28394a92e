"""Structured output and forced tool calls on the real SmolLM2-135M-Instruct: json_schema answers sampled at
temperature 1 through the openai client all validate; every token of an engine answer is one llguidance's own
check takes; greedy unconstrained rows are the same with a constrained neighbour."""

import json

import pytest
from serving import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 25}}}}
ASK = [{"role": "user", "content": "Describe a retired teacher as JSON with name, age and hobbies."}]


def validate(value):
    try:
        import jsonschema
    except ImportError:
        assert set(value) == {"name", "age", "hobbies"} and isinstance(value["name"], str)
        assert type(value["age"]) is int and 0 <= value["age"] <= 120 and len(value["hobbies"]) <= 3
    else:
        jsonschema.validate(value, SCHEMA)


@pytest.fixture(scope="module")
def smol(smollm2):
    s = ServerProcess(smollm2, "--served-model-name", "smollm2", "--kv-cache-tokens", "8192",
                      "--chat-template", "qwen")
    yield s
    assert s.stop() == 0


def test_json_schema_answers_at_temperature_1_validate(smol):
    client = openai.OpenAI(base_url=smol.base, api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="smollm2", messages=ASK, n=8, temperature=1.0, seed=11, max_tokens=120,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": SCHEMA, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        validate(json.loads(c.message.content))


def test_forced_tool_call_on_the_real_model(smol):
    client = openai.OpenAI(base_url=smol.base, api_key="x", max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 30}}}}}]
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=tools, tool_choice="required", temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    assert set(json.loads(c.message.tool_calls[0].function.arguments)) == {"city"}


def test_engine_tokens_pass_llguidance_and_neighbours_are_untouched(smollm2):
    from astrai.config.infer import EngineOptions, SamplingParams
    from astrai.infer.engine import Engine
    from astrai.infer.grammar import json_grammar, validate as ll_validate

    engine = Engine.from_checkpoint(smollm2, EngineOptions(device="cpu", dtype="float32", kv_cache_tokens=4096))
    g = json_grammar(SCHEMA)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain = [[{"role": "user", "content": "What is the capital of France?"}], ASK]
    alone = engine.generate(plain, greedy)
    reqs = [engine.add_request(p, greedy) for p in plain]
    cons = [engine.add_request(ASK, SamplingParams(max_tokens=120, temperature=1.0, seed=s), grammar=g) for s in (1, 2)]
    done = {}
    while engine.has_work():
        for r, _, _ in engine.step():
            if r.status == "finished":
                done[r.rid] = engine.completion(r, 0)
    assert [done[r.rid].token_ids for r in reqs] == [c.token_ids for c in alone]
    assert alone[0].text == "The capital of France is Paris."
    for r in cons:
        c = done[r.rid]
        validate(json.loads(c.text))
        assert ll_validate(engine.grammar, g, c.token_ids) == len(c.token_ids)
