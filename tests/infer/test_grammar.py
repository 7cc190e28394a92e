"""Constrained decoding in the engine: the mask against llguidance's own token-by-token check, schema-valid
answers at temperature 1, unconstrained neighbours untouched, stop tokens only where the grammar ends."""

import json

import pytest
import torch

pytest.importorskip("llguidance")

from astrai.infer.engine import Engine, EngineOptions  # noqa: E402
from astrai.infer.grammar import GrammarError, json_grammar, lark_grammar, response_format_grammar, validate  # noqa: E402
from astrai.infer.request import Request, SamplingParams  # noqa: E402
from astrai.infer.sampling import apply_grammar, sample  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["mood", "count", "ok", "name"],
          "properties": {"mood": {"enum": ["good", "fine", "bad"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "name": {"type": "string", "maxLength": 6}}}


def valid(value, schema) -> bool:
    """jsonschema's verdict (the reference validator), or a hand check of SCHEMA when it is absent."""
    try:
        import jsonschema
    except ImportError:
        return (isinstance(value, dict) and set(value) == set(schema["required"]) and value["mood"] in
                ("good", "fine", "bad") and type(value["count"]) is int and 0 <= value["count"] <= 99
                and type(value["ok"]) is bool and isinstance(value["name"], str) and len(value["name"]) <= 6)
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", dtype="float32", page_size=4, kv_cache_tokens=4096))


def test_sampled_answers_are_schema_valid_and_each_token_was_allowed(engine):
    g = json_grammar(SCHEMA)
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s) for s in range(8)]
    outs = engine.generate(["hello world"] * 8, params, grammar=g)
    for c in outs:
        assert c.finish_reason == "stop", c.text
        assert valid(json.loads(c.text), SCHEMA), c.text
        # llguidance's own validation of the whole output, on a fresh matcher: every token is one it takes
        assert validate(engine.grammar, g, c.token_ids) == len(c.token_ids)
    assert engine.engine_stats()["constrained_requests"] >= 8
    assert engine.engine_stats()["grammar_failures"] == 0


def test_mask_is_exactly_the_tokens_the_grammar_takes(engine):
    """The sampler's mask against a slow reference: each token of the vocabulary tried alone on a copy of the
    matcher (llguidance's try_consume_tokens); stop tokens allowed only where the grammar accepts."""
    g = lark_grammar('start: "yes" | "yes no" | "no"')
    vocab = engine.model.config.vocab_size
    eos = engine.tokenizer.eos_id
    req = Request(0, [5, 6], SamplingParams(temperature=0.0), frozenset({eos}))
    req.matcher = engine.grammar.matcher(g)
    for step in range(4):
        m = req.matcher.m
        ref = [t for t in range(vocab) if t != eos and m.deep_copy().try_consume_tokens([t]) == 1]
        logits = torch.randn(1, vocab)
        token = sample(logits.clone(), [req])[0][0]
        masked = apply_grammar(logits, [req], [0])
        allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
        assert sorted(set(allowed) - {eos}) == ref
        assert (eos in allowed) == m.is_accepting()
        assert token in allowed and token == int(masked[0].argmax())
        if token == eos or not req.matcher.advance(token) or req.matcher.done:
            break


def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(engine):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["hello world how", "the quick brown fox"]
    alone = engine.generate(prompts, greedy)
    g = json_grammar(SCHEMA)
    mixed = [None, None]
    reqs = [engine.add_request(p, greedy) for p in prompts]
    engine.add_request("please answer", SamplingParams(max_tokens=16, temperature=1.0, seed=3), grammar=g)
    while engine.has_work():
        for r, _, _ in engine.step():
            if r in reqs and r.status == "finished":
                mixed[reqs.index(r)] = engine.completion(r, 0)
    assert [c.token_ids for c in mixed] == [c.token_ids for c in alone]


def test_unconstrained_sampling_never_reaches_the_grammar(engine, monkeypatch):
    """A step with no constrained row does no grammar work at all."""
    import astrai.infer.sampling as sampling

    monkeypatch.setattr(sampling, "apply_grammar", lambda *a: pytest.fail("mask applied to unconstrained rows"))
    engine.generate("hello world", SamplingParams(max_tokens=4, temperature=1.0, seed=1))


@pytest.mark.parametrize("schema,words", [
    ({"type": "frobnicate"}, "frobnicate"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"$ref": "#/definitions/missing"}, "missing"),
])
def test_schema_the_engine_cannot_compile_says_why(engine, schema, words):
    with pytest.raises(GrammarError, match=words):
        engine.grammar.check(json_grammar(schema))
    with pytest.raises(GrammarError, match=words):
        engine.add_request("hello", SamplingParams(max_tokens=4), grammar=json_grammar(schema))
    assert not engine.has_work()


@pytest.mark.parametrize("fmt,words", [
    ({"type": "xml"}, "xml"),
    ({"type": "json_schema"}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schemas": {}}}, "schemas"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "object"),
])
def test_malformed_response_format(fmt, words):
    with pytest.raises(GrammarError, match=words):
        response_format_grammar(fmt)


def test_json_object_is_any_object(engine):
    g = response_format_grammar({"type": "json_object"})
    assert response_format_grammar({"type": "text"}) is None
    outs = engine.generate(["hello"] * 3, [SamplingParams(max_tokens=200, temperature=1.0, seed=s) for s in range(3)],
                           grammar=g)
    for c in outs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:  # a random model may still be inside a string at max_tokens: what it wrote is a prefix the grammar took
            assert validate(engine.grammar, g, c.token_ids) == len(c.token_ids)


def test_generate_json_schema_flag(checkpoint, tmp_path, capsys):
    from astrai.cli import main

    schema = tmp_path / "answer.schema.json"
    schema.write_text(json.dumps(SCHEMA))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello", "the quick brown", "yes no")))
    rc = main(["generate", str(checkpoint), "--input", str(inp), "--json-schema", str(schema), "--temperature", "1",
               "--seed", "4", "--max-tokens", "150", "--device", "cpu", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    assert len(recs) == 3
    for r in recs:
        assert r["finish_reason"] == "stop" and valid(json.loads(r["text"]), SCHEMA), r


@pytest.mark.parametrize("content,words", [
    ('{"type": "frobnicate"}', "frobnicate"),
    ('[1, 2]', "must be an object"),
    ('{"type": ', "invalid JSON"),
])
def test_generate_bad_json_schema_file_is_one_line(checkpoint, tmp_path, capsys, content, words):
    from astrai.cli import main

    schema = tmp_path / "bad.json"
    schema.write_text(content)
    rc = main(["generate", str(checkpoint), "--prompt", "hello", "--json-schema", str(schema), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and str(schema) in err and words in err, err
    assert len(err.strip().splitlines()) == 1


def test_generate_refuses_a_bad_schema_before_loading_the_model(tmp_path, capsys):
    from astrai.cli import main

    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "frobnicate"}')
    rc = main(["generate", str(tmp_path / "no-such-checkpoint"), "--prompt", "hi", "--json-schema", str(schema),
               "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "frobnicate" in err and "no-such-checkpoint" not in err, err


@pytest.mark.parametrize("mixed", [False, True])
def test_logprobs_of_a_constrained_row_are_the_models_own(engine, mixed):
    """The mask picks the token; the logprobs reported are log_softmax of the unmasked logits (vLLM's default)."""
    vocab = engine.model.config.vocab_size
    g = lark_grammar('start: "yes" | "no"')
    req = Request(0, [5, 6], SamplingParams(temperature=0.0, logprobs=2), frozenset())
    req.matcher = engine.grammar.matcher(g)
    reqs = [req] + ([Request(1, [5], SamplingParams(temperature=0.0))] if mixed else [])
    logits = torch.randn(len(reqs), vocab)
    tokens, lps = sample(logits.clone(), reqs)
    ref = logits[0].log_softmax(-1)
    assert lps[0].token_id == tokens[0] and lps[0].logprob == pytest.approx(float(ref[tokens[0]]), abs=1e-5)
    assert [t for t, _ in lps[0].top] == ref.topk(2).indices.tolist()
    assert req.matcher.m.deep_copy().try_consume_tokens([tokens[0]]) == 1
    if mixed:
        assert tokens[1] == int(logits[1].argmax())
