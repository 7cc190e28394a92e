"""The real SmolLM2-135M-Instruct behind `astrai serve`: the answer a user checks first, streamed and whole,
and text outside ASCII streamed without a character cut in two."""

import pytest
from serving import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def smol_server(smollm2):
    s = ServerProcess(smollm2, "--served-model-name", "smollm2", "--kv-cache-tokens", "8192")
    yield s
    assert s.stop() == 0


def test_capital_of_france(smol_server):
    client = openai.OpenAI(base_url=smol_server.base, api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == "The capital of France is Paris."
    assert whole.choices[0].finish_reason == "stop"  # at <|im_end|>, the template's end of turn
    parts = list(client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20, temperature=0,
                                                stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "The capital of France is Paris."


def test_multibyte_text_streams_whole_characters(smol_server):
    client = openai.OpenAI(base_url=smol_server.base, api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Write the word 'café' and the emoji 🙂 three times."}]
    whole = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=48, temperature=0)
    text = whole.choices[0].message.content
    # the answer holds characters of 4 UTF-8 bytes that SmolLM2 writes as 3 tokens each (greedy: 3 x 👩)
    assert any(len(ch.encode()) == 4 for ch in text), text
    pieces = [p.choices[0].delta.content or "" for p in client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=48, temperature=0, stream=True)]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # no piece ever carried half a character
