"""A checkpoint's generation_config.json applies to `astrai serve` and `astrai chat` as it does to `astrai
generate`: its sampling settings under whatever the request or the flags give. Reference: the engine itself,
given the same settings explicitly (seeded sampling is reproducible whatever the batch)."""

import io
import json
import shutil
import sys

import pytest
from serving import ServerProcess

from astrai.cli import main
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams

openai = pytest.importorskip("openai")

GEN_CONFIG = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.3, "do_sample": True}
OWN = {k: v for k, v in GEN_CONFIG.items() if k != "do_sample"}
CHAT = [{"role": "user", "content": "hello how are you"}]


@pytest.fixture(scope="module")
def gen_checkpoint(serve_checkpoint, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("genconfig") / "ckpt"
    shutil.copytree(serve_checkpoint, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return ckpt


@pytest.fixture(scope="module")
def reference(serve_checkpoint):
    engine = Engine.from_checkpoint(serve_checkpoint, EngineOptions(device="cpu", dtype="float32"))  # the same weights, no gen config

    def ref(prompt, **params):
        return engine.generate([prompt], SamplingParams(**params))[0].text
    return ref


def test_serve_samples_with_the_checkpoints_generation_config(gen_checkpoint, reference):
    s = ServerProcess(gen_checkpoint)
    try:
        assert any("sampling defaults from the checkpoint's generation_config.json: temperature 0.5, top_p 0.9, "
                   "top_k 3, repetition_penalty 1.3" in line for line in s.lines), s.lines
        client = openai.OpenAI(base_url=s.base, api_key="x", max_retries=0, timeout=60)
        for seed in (7, 8):
            want = reference("hello", max_tokens=12, seed=seed, ignore_eos=True, **OWN)
            assert want != reference("hello", max_tokens=12, seed=seed, ignore_eos=True)  # the settings matter here
            got = client.completions.create(model=str(gen_checkpoint), prompt="hello", max_tokens=12, seed=seed,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == want
        chat = client.chat.completions.create(model=str(gen_checkpoint), messages=CHAT, max_tokens=8, seed=3)
        assert chat.choices[0].message.content == reference(CHAT, max_tokens=8, seed=3, **OWN)
        # the request's own values win, key by key (greedy here, still with the file's repetition_penalty)
        got = client.completions.create(model=str(gen_checkpoint), prompt="hello", max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == reference("hello", max_tokens=12, ignore_eos=True, **{**OWN, "temperature": 0})
        got = client.completions.create(model=str(gen_checkpoint), prompt="hello", max_tokens=12, seed=7,
                                        extra_body={"ignore_eos": True, "top_k": 50})
        assert got.choices[0].text == reference("hello", max_tokens=12, seed=7, ignore_eos=True, **{**OWN, "top_k": 50})
    finally:
        assert s.stop() == 0


def test_do_sample_false_is_greedy_in_serve(serve_checkpoint, tmp_path, reference):
    ckpt = tmp_path / "greedy"
    shutil.copytree(serve_checkpoint, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    s = ServerProcess(ckpt)
    try:
        client = openai.OpenAI(base_url=s.base, api_key="x", max_retries=0, timeout=60)
        greedy = reference("the quick", max_tokens=10, temperature=0, ignore_eos=True)
        for seed in (1, 2):
            got = client.completions.create(model=str(ckpt), prompt="the quick", max_tokens=10, seed=seed,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == greedy
    finally:
        assert s.stop() == 0


def test_chat_samples_with_the_checkpoints_generation_config(gen_checkpoint, reference, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello how are you\n"))
    assert main(["chat", str(gen_checkpoint), "--max-tokens", "8", "--seed", "5", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.split("\n")[0] == reference(CHAT, max_tokens=8, seed=5, **OWN)
    assert out.split("\n")[0] != reference(CHAT, max_tokens=8, seed=5)
    assert "generation_config.json: temperature 0.5" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello how are you\n"))  # a flag wins over the file
    assert main(["chat", str(gen_checkpoint), "--max-tokens", "8", "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == reference(CHAT, max_tokens=8, **{**OWN, "temperature": 0})


def test_command_defaults_of_max_tokens_hold_under_any_sampling_keys():
    """chat answers up to 512 tokens and generate 256 unless told (a sampling block without max_tokens keeps the
    command's default); a checkpoint's generation_config.json never sets max_tokens."""
    from astrai.config.infer import GenerateOptions, with_checkpoint_defaults
    from astrai.config.serve import ChatOptions

    chat = ChatOptions.model_validate({"checkpoint": "c", "sampling": {"temperature": 0.5}})
    assert chat.sampling.max_tokens == 512 and ChatOptions(checkpoint="c").sampling.max_tokens == 512
    assert with_checkpoint_defaults(chat.sampling, OWN).model_dump() == {
        **SamplingParams(max_tokens=512).model_dump(), **OWN, "temperature": 0.5}
    gen = GenerateOptions.model_validate({"checkpoint": "c", "prompt": "p", "sampling": {"top_k": 2}})
    assert gen.sampling.max_tokens == 256 and gen.sampling.top_k == 2
    assert ChatOptions.model_validate({"checkpoint": "c", "sampling": {"max_tokens": 9}}).sampling.max_tokens == 9
