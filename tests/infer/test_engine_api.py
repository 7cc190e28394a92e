"""Engine API: streaming, stop strings and ids, seeds, chat prompts, logprobs, abort, errors."""

import pytest
import torch

from astrai.text.template import TEMPLATE_DIR
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams
from astrai.infer.scheduler import RequestTooLarge

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello how are you"}]


@pytest.fixture
def engine(checkpoint):
    return Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", dtype="float32", page_size=4, kv_cache_tokens=2048))


def test_stream_pieces_add_up_to_the_completion(engine):
    prompts = ["hello world", "the quick brown fox", CHAT]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    pieces = {0: [], 1: [], 2: []}
    finals = {}
    for ev in engine.stream(prompts, params):
        pieces[ev.index].append(ev.text)
        if ev.completion is not None:
            finals[ev.index] = ev.completion
    assert sorted(finals) == [0, 1, 2]
    for i, c in finals.items():
        assert "".join(pieces[i]) == c.text
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == engine.tokenizer.tok.decode(c.token_ids)
    stats = engine.engine_stats()
    assert stats["generated_tokens"] == 36 and stats["tokens_per_second"] > 0


def test_same_seed_same_output_whatever_the_batch(engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate("hello world", p)[0]
    others = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (3, 15, 7)]
    crowded = engine.generate(["how are you", "the lazy dog", "hello world", "one two"],
                              [others[0], others[1], p, others[2]])
    assert crowded[2].token_ids == alone.token_ids
    different = engine.generate("hello world", p.model_copy(update={"seed": 99}))[0]
    assert different.token_ids != alone.token_ids


def test_stop_token_ids_and_strings(engine):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = engine.generate("hello world", greedy)[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = engine.generate("hello world", greedy.model_copy(update={"stop_token_ids": [stop_id]}))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[:first + 1]
    needle = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    out = engine.generate("hello world", greedy.model_copy(update={"stop": [needle]}))[0]
    assert out.finish_reason == "stop" and out.stop_reason == needle
    assert out.text == full.text[:full.text.index(needle)]


def test_chat_prompt_is_rendered_like_transformers(engine, checkpoint):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), bos_token="<s>",
                                     eos_token="</s>")
    hf_tok.chat_template = (TEMPLATE_DIR / "chatml.jinja").read_text()
    expected = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    req = engine.add_request(CHAT, SamplingParams(max_tokens=1))
    assert req.prompt_ids == list(expected)
    assert engine.eot_id == engine.tokenizer.tok.token_to_id("<|im_end|>") and engine.eot_id in req.stop_ids
    plain = engine.add_request("hello", SamplingParams(max_tokens=1))
    assert engine.eot_id not in plain.stop_ids  # raw text continues past a chat end marker
    engine.abort(req)
    engine.abort(plain)


def test_logprobs_match_a_full_forward(engine):
    out = engine.generate("hello world", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3,
                                                        ignore_eos=True))[0]
    from astrai.model import CausalContext

    ids = torch.tensor(out.prompt_token_ids + out.token_ids)
    with torch.inference_mode():
        lp = engine.model.logits(engine.model(ids, torch.arange(len(ids)), CausalContext())).log_softmax(-1)
    n = len(out.prompt_token_ids)
    for i, (t, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got.token_id == t and got.top[0][0] == t  # greedy: the chosen token is the most likely
        assert got.logprob == pytest.approx(lp[n - 1 + i, t].item(), abs=1e-5)
        assert len(got.top) == 3


def test_breaking_out_of_a_stream_frees_memory(engine):
    stream = engine.stream(["hello", "world how"], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not engine.has_work()
    engine.pool.check([])


def test_request_too_large_is_an_error_not_a_hang(checkpoint):
    engine = Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", dtype="float32", page_size=4, kv_cache_tokens=32))
    with pytest.raises(RequestTooLarge, match="lower max_tokens"):
        engine.generate("hello world", SamplingParams(max_tokens=40))
    assert not engine.has_work()
    assert engine.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))[0].finish_reason == "length"


def test_options_are_strict():
    with pytest.raises(ValueError, match="page_sise"):
        EngineOptions(page_sise=4)


def test_cpu_lm_head_copy_follows_the_weight(engine):
    """The runner's transposed LM-head copy gives the model's logits, and is remade when the weight
    changes in place (a model trained between generations must not sample from stale logits): the
    step's weight check sees the change."""
    runner, model = engine.runner, engine.model
    h = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(runner.logits(h), model.logits(h), atol=1e-5, rtol=1e-5)
        model.lm_head.weight.mul_(-2.0)
        assert runner.sync_weights()  # what Engine.step does first
        torch.testing.assert_close(runner.logits(h), model.logits(h), atol=1e-5, rtol=1e-5)


def test_stepping_an_idle_engine_returns_nothing(engine):
    """Before any request and after the last has finished, a step has nothing to run: no tokens, no error."""
    assert engine.step() == []
    done = engine.generate("hello world", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(done.token_ids) == 3
    assert engine.step() == [] and engine.step() == []
    assert engine.generate("hello world", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].token_ids == done.token_ids
