"""Many clients at once: continuous batching, clients that leave, and no page left held afterwards."""

import asyncio
import random
import socket
import time

import pytest
from serving import ServerProcess

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def metric(server, name: str, labels: str = "") -> float:
    for line in server.text("/metrics").splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    raise KeyError(name + labels)


def assert_idle_and_whole(server):
    h = server.idle_health()
    assert (h["running"], h["waiting"]) == (0, 0), h
    assert h["kv_tokens_free"] + h["kv_tokens_cached"] == h["kv_tokens_total"], h


def test_200_requests_16_clients_10_percent_leave(server, serve_checkpoint):
    rng = random.Random(0)
    plan = [(i, rng.random() < 0.1, rng.choice([True, False]), rng.randint(4, 40)) for i in range(200)]
    n_leave = sum(leave for _, leave, _, _ in plan)
    aborts_before = metric(server, "astrai_requests_total", '{finish_reason="abort"}')
    steps_before = []

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
        queue = asyncio.Queue()
        for p in plan:
            queue.put_nowait(p)
        results, peak = {}, [0]

        async def worker():
            while not queue.empty():
                i, leave, chat, max_tokens = queue.get_nowait()
                kw = dict(model=str(serve_checkpoint), max_tokens=2000 if leave else max_tokens, temperature=0.8,
                          seed=i, stream=True, extra_body={"ignore_eos": True})
                if chat:
                    stream = await client.chat.completions.create(
                        messages=[{"role": "user", "content": f"question {i}: how are you today"}], **kw)
                else:
                    stream = await client.completions.create(prompt=f"the quick brown fox {i}", **kw)
                n = 0
                async for chunk in stream:
                    if chunk.choices and (chunk.choices[0].finish_reason is None):
                        n += 1
                    if leave and n == 3:
                        break  # mid-stream: 1997 tokens still to go when the client goes away
                await stream.close()
                results[i] = n

        async def watch():  # continuous batching: requests of different clients in flight together
            async with httpx.AsyncClient() as c:
                while len(results) < len(plan):
                    peak[0] = max(peak[0], (await c.get(server.url + "/health")).json()["running"])
                    await asyncio.sleep(0.05)

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(16)), watch())
        return results, peak[0], time.monotonic() - t0

    results, peak, seconds = asyncio.run(main())
    assert len(results) == 200
    assert peak > 1
    for i, leave, chat, max_tokens in plan:
        if not leave:
            assert results[i] >= 1  # tokens of a random model may be invisible text; most are not
    assert_idle_and_whole(server)
    aborted = metric(server, "astrai_requests_total", '{finish_reason="abort"}') - aborts_before
    assert aborted == n_leave  # each leaver was cancelled, none ran on to its 2000 tokens
    assert n_leave >= 10


def test_a_non_streaming_client_that_leaves_cancels_its_request(server, serve_checkpoint):
    before = metric(server, "astrai_requests_total", '{finish_reason="abort"}')
    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/completions", json=body, timeout=httpx.Timeout(5.0, read=0.5))
    assert_idle_and_whole(server)
    assert metric(server, "astrai_requests_total", '{finish_reason="abort"}') == before + 1


@pytest.fixture(scope="module")
def stall_server(serve_checkpoint):
    s = ServerProcess(serve_checkpoint, "--stall-timeout", "1")
    yield s
    assert s.stop() == 0


def test_a_client_that_stops_reading_is_cancelled(stall_server):
    """A stream whose client keeps the connection open but reads nothing: once the socket buffers are full
    and a write has waited --stall-timeout seconds, the request is cancelled and the connection closed."""
    host, port = stall_server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block soon
    sock.connect((host, int(port)))
    # 4 choices x 2000 tokens x ~2.5 kB of logprobs per chunk: far more than the socket buffers hold (~4 MB)
    body = (b'{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2000, "ignore_eos": true, '
            b'"stream": true, "n": 4, "logprobs": true, "top_logprobs": 20}')
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    sock.recv(100)  # the stream started
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        h = stall_server.get("/health")
        if h["running"] == 0 and "stale" not in h:
            break
        time.sleep(0.2)
    assert (h["running"], h["waiting"]) == (0, 0)
    assert metric(stall_server, "astrai_requests_total", '{finish_reason="abort"}') == 4
    assert metric(stall_server, "astrai_requests_total", '{finish_reason="length"}') == 0
    sock.close()
    assert_idle_and_whole(stall_server)
