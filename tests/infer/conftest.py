import sys
from pathlib import Path

import pytest

# tests/model/families.py (tiny transformers models of every family) is shared with the engine's tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer, make_chat_checkpoint):
    """A tiny random model directory with the test tokenizer and a ChatML template in tokenizer_config."""
    return make_chat_checkpoint(tmp_path_factory.mktemp("ckpt"), tiny_tokenizer)
