"""Size bounds checked before the chat template and tokenizer run, the number of choices before any encoding,
long prompts tokenized without stalling /health, and the engine's own id checks answered as 400s."""

import json
import threading
import time

import pytest
from serving import ServerProcess, assert_error, strict_json

httpx = pytest.importorskip("httpx")

CHARS_PER_TOKEN = 16  # the documented default bound: --max-prompt-chars = 16 x the context


class HealthProbe:
    """/health polled on fresh connections from a thread; the slowest answer seen."""

    def __init__(self, server):
        self.server, self.latencies, self.errors = server, [], []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                assert httpx.get(self.server.url + "/health", timeout=30).status_code == 200
            except Exception as e:  # noqa: BLE001  (reported by the test)
                self.errors.append(e)
            self.latencies.append(time.monotonic() - t0)
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()


def context(server) -> int:
    return httpx.get(server.base + "/models").json()["data"][0]["max_model_len"]


def test_prompts_past_the_character_bound_are_refused_before_tokenizing(server):
    ctx = context(server)
    bound = CHARS_PER_TOKEN * ctx
    status, err = server.post("/v1/completions", {"prompt": "a" * (bound + 1)})
    assert_error(status, err, 400, "prompt", f"the prompt has {bound + 1:,} characters")
    assert err["error"]["code"] == "context_length_exceeded" and "--max-prompt-chars" in err["error"]["message"]
    two = [{"role": "user", "content": "b" * (bound // 2)}, {"role": "assistant", "content": "c" * (bound // 2)}]
    status, err = server.post("/v1/chat/completions", {"messages": two})
    assert_error(status, err, 400, "messages", f"more than {bound:,} characters")
    # within the bound the prompt is tokenized, and refused by its token count
    status, err = server.post("/v1/completions", {"prompt": "hello " * (bound // 6)})
    assert_error(status, err, 400, "max_tokens", "tokens and max_tokens is 16")
    # token ids: their number against the context before any id is looked at
    status, err = server.post("/v1/completions", {"prompt": [99999] * (ctx + 1)})
    assert_error(status, err, 400, "prompt", f"the prompt has {ctx + 1} tokens")


def test_four_8_mb_prompts_do_not_stall_health(server):
    body = json.dumps({"prompt": "hello world how are you " * (8 * 2 ** 20 // 24), "max_tokens": 1}).encode()
    answers = []

    def send():
        r = httpx.post(server.base + "/completions", content=body, timeout=120,
                       headers={"content-type": "application/json"})
        answers.append((r.status_code, strict_json(r.content)))

    with HealthProbe(server) as probe:
        senders = [threading.Thread(target=send) for _ in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        time.sleep(0.2)
    assert len(answers) == 4
    for status, err in answers:
        assert_error(status, err, 400, "prompt", "characters; this server takes at most")
    assert not probe.errors and max(probe.latencies) < 1.0, max(probe.latencies)


def test_a_batch_past_what_the_server_takes_is_refused_before_encoding(server):
    """30,000 prompts of 1,000 characters: tokenizing them would take minutes; the count is checked first."""
    body = json.dumps({"prompt": ["hello world how are you " * 40] * 30_000, "max_tokens": 1}).encode()
    t0 = time.monotonic()
    r = httpx.post(server.base + "/completions", content=body, timeout=300,
                   headers={"content-type": "application/json"})
    assert_error(r.status_code, strict_json(r.content), 400, "n", "30000 choices (n x prompts)")
    assert time.monotonic() - t0 < 10


def test_stop_token_ids_outside_the_vocabulary_are_400(server, serve_checkpoint):
    vocab = json.loads((serve_checkpoint / "config.json").read_text())["vocab_size"]
    status, err = server.post("/v1/completions", {"prompt": "hello", "stop_token_ids": [3, vocab]})
    assert_error(status, err, 400, "stop_token_ids", f"stop token id {vocab} is outside the model's vocabulary")
    status, err = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "stop_token_ids": [10 ** 9]})
    assert_error(status, err, 400, "stop_token_ids", "outside the model's vocabulary")
    status, ok = server.post("/v1/completions", {"prompt": "hello", "stop_token_ids": [vocab - 1], "max_tokens": 2})
    assert status == 200


@pytest.fixture(scope="module")
def roomy_server(serve_checkpoint):
    """A server that lets prompts of 2 million characters through to the tokenizer."""
    s = ServerProcess(serve_checkpoint, "--max-prompt-chars", "2000000")
    yield s
    assert s.stop() == 0, "".join(s.stderr)[-3000:]


def test_long_prompts_are_tokenized_without_stalling_health(roomy_server):
    """Four 512 KiB prompts, each about 1.5 s of tokenizing, at once: tokenized in worker threads that release
    the GIL, then refused by their token count; /health answers within a second all along."""
    body = json.dumps({"prompt": "hello world how are you " * (2 ** 19 // 24), "max_tokens": 1}).encode()
    answers = []

    def send():
        r = httpx.post(roomy_server.base + "/completions", content=body, timeout=300,
                       headers={"content-type": "application/json"})
        answers.append((r.status_code, strict_json(r.content)))

    with HealthProbe(roomy_server) as probe:
        senders = [threading.Thread(target=send) for _ in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
    assert len(answers) == 4
    for status, err in answers:
        assert_error(status, err, 400, "max_tokens", "tokens and max_tokens is 1")  # it was tokenized
    # the probes ran while the prompts were tokenized (each probe takes 0.1-0.2 s with its pause; on a CPU with
    # AVX-512 the four prompts took about 0.6 s, so five probes, not six, fitted)
    assert not probe.errors and len(probe.latencies) >= 3 and max(probe.latencies) < 1.0, probe.latencies
