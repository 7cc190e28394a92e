"""The real pretrained SmolLM2-135M-Instruct (tests/conftest.py smollm2): greedy chat generation through
the engine equals transformers' `generate` token for token, and answers the question."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_greedy_chat_equals_transformers(smollm2):
    from astrai.infer.engine import Engine
    from astrai.infer.request import SamplingParams

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref = hf.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    (out,) = Engine.from_checkpoint(smollm2).generate([chat], SamplingParams(max_tokens=24, temperature=0))
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()  # the template's default system prompt
    assert out.token_ids == ref[:len(out.token_ids)] and ref[len(out.token_ids) - 1] == tok.eos_token_id
    assert out.text == "The capital of France is Paris."
