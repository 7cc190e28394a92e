"""No NaN or Infinity in any JSON the server writes, even from a model whose output is not a number: every body
and every stream chunk is read with a strict JSON parser (Python's json.loads accepts NaN; JSON does not)."""

import json
import math
import shutil

import pytest
from serving import ServerProcess, assert_error, strict_json

from astrai.infer.sampling import TokenLogprob
from astrai.serve.responses import LOGPROB_FLOOR, NotFinite, TokenText, chat_logprobs, completion_logprobs

httpx = pytest.importorskip("httpx")
CHAT = [{"role": "user", "content": "hello"}]


def test_logprobs_of_minus_infinity_are_written_as_the_floor_and_nan_refused():
    tt = TokenText(None)
    lps = [TokenLogprob(3, -0.5, [(3, -0.5), (4, -math.inf)]), TokenLogprob(4, -math.inf, [(4, -math.inf)])]
    assert chat_logprobs(lps, tt)["content"][1]["logprob"] == LOGPROB_FLOOR == -9999.0
    assert [t["logprob"] for t in chat_logprobs(lps, tt)["content"][0]["top_logprobs"]] == [-0.5, -9999.0]
    legacy = completion_logprobs(lps, tt)
    assert legacy["token_logprobs"] == [-0.5, -9999.0] and legacy["top_logprobs"][0] == {"<3>": -0.5, "<4>": -9999.0}
    for bad in (math.nan, math.inf):
        with pytest.raises(NotFinite, match="not a number"):
            chat_logprobs([TokenLogprob(3, bad, [])], tt)
        with pytest.raises(NotFinite):
            completion_logprobs([TokenLogprob(3, -1.0, [(3, bad)])], tt)


@pytest.fixture(scope="module")
def nan_server(serve_checkpoint, tmp_path_factory):
    """The tiny checkpoint with its final norm scaled to 3e38: finite weights (they load) whose logits overflow
    to inf, so every logprob is NaN."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path_factory.mktemp("nan") / "ckpt"
    shutil.copytree(serve_checkpoint, ckpt)
    weights = load_file(ckpt / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], 3e38)
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    s = ServerProcess(ckpt)
    yield s
    assert s.stop() == 0, "".join(s.stderr)[-3000:]


def test_nan_logprobs_are_an_error_in_strict_json(nan_server):
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2}),
                       ("/v1/completions", {"prompt": "hello", "logprobs": 2})):
        status, err = nan_server.post(path, {**body, "max_tokens": 3, "temperature": 0})
        assert_error(status, err, 500, None, "not a number")
        assert err["error"]["code"] == "model_output_not_finite" and "check the checkpoint" in err["error"]["message"]
    status, ok = nan_server.post("/v1/completions", {"prompt": "hello", "max_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True})
    assert status == 200 and ok["usage"]["completion_tokens"] == 3  # without logprobs nothing is a float


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "hello", "logprobs": 2}),
])
def test_nan_logprobs_end_a_stream_with_an_error_event_in_strict_json(nan_server, path, body):
    r = httpx.post(nan_server.url + path, json={**body, "max_tokens": 3, "temperature": 0, "stream": True},
                   timeout=60)
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    payloads = [strict_json(e) for e in events[:-1]]  # every chunk parses strictly
    assert "error" in payloads[-1] and payloads[-1]["error"]["code"] == "model_output_not_finite"
    assert not any(math.isnan(x) for p in payloads for x in _floats(p))


def _floats(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floats(v)
    elif isinstance(value, list):
        for v in value:
            yield from _floats(v)


def test_a_model_that_is_fine_still_gets_finite_logprobs(server):
    status, got = server.post("/v1/completions", {"prompt": "hello", "logprobs": 3, "max_tokens": 4,
                                                  "temperature": 0})
    assert status == 200
    lp = got["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and all(-50 < x <= 0 for x in lp["token_logprobs"])
    assert json.loads(json.dumps(got, allow_nan=False)) == got
