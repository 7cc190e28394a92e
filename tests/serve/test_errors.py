"""Every error of the API in OpenAI's shape and status code, and a server that keeps serving after them all."""

import asyncio
import json

import pytest
from serving import ServerProcess, assert_error

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("body,param,words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"messages": "hello"}, "messages", "valid array"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature", "valid number"),
    ({"messages": CHAT, "max_tokens": 2.5}, "max_tokens", "valid integer"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({"messages": CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ({"messages": CHAT, "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"messages": CHAT, "stop": 5}, "stop", "valid"),
    ({"messages": CHAT, "stop": [""]}, "stop", "empty"),
    ({"messages": CHAT, "stream": "yes"}, "stream", "valid boolean"),
    ({"messages": CHAT, "temprature": 0}, "temprature", "Unrecognized request argument"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"messages": CHAT, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "only text parts"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": CHAT, "seed": 2 ** 64}, "seed", "less than or equal to"),
    ({"messages": CHAT, "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"messages": CHAT, "n": 129}, "n", "less than or equal to 128"),
])
def test_bad_chat_requests_are_400_naming_the_field(server, body, param, words):
    status, err = server.post("/v1/chat/completions", body)
    assert_error(status, err, 400, param, words)


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, 2, 99999]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "echo": True}, "echo", "not supported"),
    ({"prompt": "hi", "logprobs": "3"}, "logprobs", "valid integer"),
    ({"prompt": {"text": "hi"}}, "prompt", "valid"),
    ({}, "prompt", "Field required"),
])
def test_bad_completion_requests_are_400(server, body, param, words):
    status, err = server.post("/v1/completions", body)
    assert_error(status, err, 400, param, words)


def test_too_large_bodies_and_batches(server):
    import http.client

    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(33 * 2 ** 20))  # refused on the header, before any byte is read
    conn.endheaders()
    r = conn.getresponse()
    assert_error(r.status, json.loads(r.read()), 413, None, "larger than 32 MiB")
    conn.close()
    status, err = server.post("/v1/completions", {"prompt": ["a"] * 40, "n": 10})
    assert_error(status, err, 400, "n", "400 choices")


def test_context_overflow_names_both_numbers(server, client, serve_checkpoint):
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=str(serve_checkpoint), prompt=[5] * 100, max_tokens=ctx)
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"{ctx} tokens" in err["message"] and "100 tokens" in err["message"] and f"max_tokens is {ctx}" in err["message"]
    with pytest.raises(openai.BadRequestError, match=str(ctx + 1)):  # a prompt that alone fills the context
        client.completions.create(model=str(serve_checkpoint), prompt=[5] * (ctx + 1))
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, max_completion_tokens=ctx)


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_server_still_serves_and_no_page_is_held(server, client, serve_checkpoint):
    got = client.chat.completions.create(model=str(serve_checkpoint), messages=CHAT, max_tokens=3)
    assert got.choices[0].finish_reason in ("stop", "length")
    h = server.idle_health()
    assert h["status"] == "ok" and h["running"] == h["waiting"] == 0
    assert h["kv_tokens_free"] + h["kv_tokens_cached"] == h["kv_tokens_total"]


@pytest.fixture(scope="module")
def strict_server(serve_checkpoint):
    s = ServerProcess(serve_checkpoint, "--api-key", "sekrit", "--max-running", "1", "--max-queue", "1",
                      "--served-model-name", "tiny-chat")
    yield s
    assert s.stop() == 0


def test_api_key(strict_server):
    bad = openai.OpenAI(base_url=strict_server.base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(strict_server.base + "/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(strict_server.base + "/models")
    assert r.status_code == 401
    good = openai.OpenAI(base_url=strict_server.base, api_key="sekrit", max_retries=0)
    assert good.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=2).model == "tiny-chat"
    assert httpx.get(strict_server.url + "/health").status_code == 200  # health and metrics stay open


def test_full_queue_is_429_and_the_rest_is_served(strict_server):
    async def main():
        client = openai.AsyncOpenAI(base_url=strict_server.base, api_key="sekrit", max_retries=0)

        async def one(i):
            try:
                r = await client.completions.create(model="tiny-chat", prompt=f"hello {i}", max_tokens=60,
                                                    extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            except openai.RateLimitError as e:
                assert e.status_code == 429 and "--max-queue 1" in e.body["message"]
                return 429

        return await asyncio.gather(*(one(i) for i in range(6)))

    results = asyncio.run(main())
    # one running + one waiting at most; the others are refused at once rather than queued without bound
    assert results.count(429) >= 1 and all(r in (60, 429) for r in results) and results.count(60) >= 2
    h = strict_server.idle_health()
    assert (h["running"], h["waiting"]) == (0, 0) and h["kv_tokens_free"] + h["kv_tokens_cached"] == h["kv_tokens_total"]


def test_errors_are_valid_json_objects_with_the_four_keys(server):
    status, err = server.post("/v1/completions", b"\xff\xfe")
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}
    assert json.loads(json.dumps(err)) == err
