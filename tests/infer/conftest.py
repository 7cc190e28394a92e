import json
import shutil

import pytest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    """A tiny random model directory with the test tokenizer and a ChatML template in tokenizer_config."""
    torch = pytest.importorskip("torch")
    from astrai.text.template import TEMPLATE_DIR
    from astrai.model import CausalLM, ModelConfig, save_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    save_model(CausalLM(ModelConfig.preset("tiny", initializer_range=0.1, eos_token_id=None)), path)
    shutil.copy(tiny_tokenizer / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": (TEMPLATE_DIR / "chatml.jinja").read_text()}))
    return path
