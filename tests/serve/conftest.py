"""Fixtures of the server tests: a tiny chat checkpoint and `astrai serve` on it (see serving.py)."""

import os
import sys

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))  # lora_random

from serving import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory, tiny_tokenizer, make_chat_checkpoint):
    return make_chat_checkpoint(tmp_path_factory.mktemp("serve-ckpt"), tiny_tokenizer)


@pytest.fixture(scope="session")
def server(serve_checkpoint):
    """The tiny chat checkpoint behind a server shared by the tests (small pages so prompts share several);
    tests read counters as differences and prompts are their own, so they do not depend on each other."""
    s = ServerProcess(serve_checkpoint, "--page-size", "4", "--kv-cache-tokens", "16384")
    yield s
    assert s.stop() == 0, "".join(s.stderr)[-3000:]


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
