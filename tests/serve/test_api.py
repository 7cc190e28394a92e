"""The OpenAI API of `astrai serve`, driven by the official `openai` client and by raw HTTP.

References: `astrai generate` (same checkpoint, same options) for the text; transformers' forward of
the same checkpoint for logprobs; the SSE framing as the OpenAI API documents it.
"""

import json
import urllib.request

import pytest

from astrai.cli import main

openai = pytest.importorskip("openai")

ENGINE = ["--device", "cpu", "--dtype", "float32", "--page-size", "4", "--kv-cache-tokens", "16384"]  # as the `server` fixture
CHATS = [[{"role": "user", "content": "hello how are you"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"},
          {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over the lazy dog?"}]]


def generate_records(checkpoint, tmp_path, flag, payload, *args):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in payload))
    assert main(["generate", str(checkpoint), flag, str(src), "--output", str(out), *ENGINE, *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_chat_greedy_equals_astrai_generate(server, client, serve_checkpoint, tmp_path):
    ref = generate_records(serve_checkpoint, tmp_path, "--chat", CHATS, "--max-tokens", "12", "--temperature", "0")
    for chat, r in zip(CHATS, ref):
        got = client.chat.completions.create(model=str(serve_checkpoint), messages=chat, max_tokens=12, temperature=0)
        c = got.choices[0]
        assert c.message.content == r["text"] and c.message.role == "assistant"
        assert got.usage.completion_tokens == len(r["token_ids"]) and got.usage.prompt_tokens == r["prompt_tokens"]
        assert c.finish_reason == r["finish_reason"]
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_text_completion_greedy_equals_astrai_generate(server, client, serve_checkpoint, tmp_path):
    prompts = [{"prompt": "hello world"}, {"prompt": "the quick brown"}]
    ref = generate_records(serve_checkpoint, tmp_path, "--input", prompts, "--max-tokens", "9", "--temperature", "0",
                           "--ignore-eos")
    got = client.completions.create(model=str(serve_checkpoint), prompt=[p["prompt"] for p in prompts], max_tokens=9,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [r["text"] for r in ref]
    assert [c.index for c in got.choices] == [0, 1] and {c.finish_reason for c in got.choices} == {"length"}
    assert got.usage.prompt_tokens == sum(r["prompt_tokens"] for r in ref) and got.usage.completion_tokens == 18
    # token ids in, as in the engine's own API
    ids = client.completions.create(model=str(serve_checkpoint), prompt=ref[0]["token_ids"][:1] + [5, 6, 7],
                                    max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_streamed_chunks_join_to_the_whole_answer(server, client, serve_checkpoint):
    for chat in CHATS:
        whole = client.chat.completions.create(model=str(serve_checkpoint), messages=chat, max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True})
        chunks = list(client.chat.completions.create(model=str(serve_checkpoint), messages=chat, max_tokens=20,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert all(c.usage is None for c in chunks[:-1])
    whole = client.completions.create(model=str(serve_checkpoint), prompt="hello", max_tokens=15, temperature=0)
    parts = list(client.completions.create(model=str(serve_checkpoint), prompt="hello", max_tokens=15, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sse_framing_as_openai_sends_it(server):
    body = json.dumps({"messages": CHATS[0], "max_tokens": 4, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(server.base + "/chat/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"} and len({p["id"] for p in payloads}) == 1
    assert "usage" not in payloads[0]


def test_n_choices_share_the_prompt_pages(server, client, serve_checkpoint):
    def hits():
        text = server.text("/metrics")
        return int(float(next(l.split()[1] for l in text.splitlines()
                               if l.startswith("astrai_prefix_cache_hit_tokens_total "))))

    chat = [{"role": "user", "content": "number one two three four five six seven eight nine " * 3}]
    before = hits()
    got = client.chat.completions.create(model=str(serve_checkpoint), messages=chat, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert len({c.message.content for c in got.choices}) == 1  # greedy: three times the same answer
    n_prompt = got.usage.prompt_tokens
    assert got.usage.completion_tokens % 3 == 0 and 3 <= got.usage.completion_tokens <= 18
    # choices 2 and 3 found the prompt's full pages (page size 4) that choice 1 computed
    assert hits() - before >= 2 * ((n_prompt - 1) // 4 * 4)
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # the prompt itself was new

    sampled = [client.chat.completions.create(model=str(serve_checkpoint), messages=chat, max_tokens=8, n=3,
                                              temperature=1.0, seed=11, extra_body={"ignore_eos": True})
               for _ in range(2)]
    texts = [[c.message.content for c in s.choices] for s in sampled]
    assert texts[0] == texts[1]  # seeded: reproducible
    assert len(set(texts[0])) > 1  # and each choice draws on its own
    assert sampled[1].usage.prompt_tokens_details.cached_tokens >= (n_prompt - 1) // 4 * 4


def test_seed_reproducible_and_stop_strings(server, client, serve_checkpoint):
    def ask(**kw):
        return client.completions.create(model=str(serve_checkpoint), prompt="the quick", max_tokens=16,
                                         extra_body={"ignore_eos": True}, **kw).choices[0]

    a, b, c = ask(temperature=1.0, seed=5), ask(temperature=1.0, seed=5), ask(temperature=1.0, seed=6)
    assert a.text == b.text and a.text != c.text
    full = ask(temperature=0)
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), full.text
    cut = ask(temperature=0, stop=[stop, "never-appears"])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    one = ask(temperature=0, stop=stop)
    assert one.text == cut.text
    streamed = client.completions.create(model=str(serve_checkpoint), prompt="the quick", max_tokens=16, stop=stop,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in streamed) == cut.text


def test_logprobs_equal_transformers(server, client, serve_checkpoint):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from astrai.infer.engine import Engine, EngineOptions
    from astrai.infer.request import SamplingParams

    ref = Engine.from_checkpoint(serve_checkpoint, EngineOptions(device="cpu", dtype="float32")).generate(
        CHATS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(serve_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ref.prompt_token_ids + ref.token_ids])).logits[0]
    lp = logits[len(ref.prompt_token_ids) - 1:-1].log_softmax(-1)
    got = client.chat.completions.create(model=str(serve_checkpoint), messages=CHATS[0], max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == 6
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(serve_checkpoint / "tokenizer.json"))
    for i, (entry, tid) in enumerate(zip(content, ref.token_ids)):
        assert entry.logprob == pytest.approx(lp[i, tid].item(), abs=1e-4)
        top = lp[i].topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.token == tok.decode([tid])
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == tok.decode(ref.token_ids)
    # legacy completions: logprobs=k gives tokens, token_logprobs, top_logprobs, text_offset
    legacy = client.completions.create(model=str(serve_checkpoint), prompt=ref.prompt_token_ids, max_tokens=6,
                                       temperature=0, logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx([lp[i, t].item() for i, t in enumerate(ref.token_ids)], abs=1e-4)
    assert all(len(t) == 2 for t in legacy.top_logprobs)
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(6)]


def test_models_and_aliases(server, client, serve_checkpoint):
    assert server.url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    assert not any("reachable from the network" in line for line in server.lines)
    models = client.models.list().data
    assert [m.id for m in models] == [str(serve_checkpoint)]
    r = client.chat.completions.create(model=serve_checkpoint.name, messages=CHATS[0], max_tokens=2)
    assert r.model == serve_checkpoint.name
