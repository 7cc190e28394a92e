import pytest


@pytest.fixture
def loads_in_transformers():
    """check(path): transformers' AutoModelForCausalLM loads the checkpoint directory and gives our
    model's logits on random ids (float32, 1e-4)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from astrai.model import CausalContext, load_model

    def check(path, n: int = 12):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ours = load_model(path, dtype=torch.float32).eval()
        ids = torch.randint(0, ours.config.vocab_size, (n,))
        with torch.no_grad():
            got = ours.logits(ours(ids, torch.arange(n), CausalContext()))
            ref = hf(input_ids=ids[None], use_cache=False).logits[0]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    return check


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_tokenizer):
    """A 'pretrained' tiny checkpoint whose vocabulary covers the tiny tokenizer."""
    import torch

    from astrai.model import CausalLM, ModelConfig, save_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base") / "base"
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=448, tie_word_embeddings=True)), path)
    return path
