"""The tokenizer stage against Hugging Face: AutoTokenizer loads the directory we write and agrees
with astrai's own loader on ids, special tokens and the chat template render."""

import json
import os
import subprocess
import sys

import pytest

from astrai.errors import InputError
from astrai.recipe.tokenizer import TokenizerOptions, record_texts, special_tokens_for, train_tokenizer

SAMPLES = [
    "Hello world, how are you today?",
    "  leading spaces, trailing spaces   ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n",
    "ünïcödé — emoji 🙂 and CJK 漢字 and tabs\tand\nnewlines",
    "numbers 1234567890 and code: def f(x): return x**2",
    "",
]


def _records(n=200):
    words = "the cat sat on a mat while dogs ran past quickly and birds sang songs of spring".split()
    out = []
    for i in range(n):
        text = " ".join(words[(i * 3 + j) % len(words)] for j in range(8 + i % 5))
        out.append({"id": f"rec-{i}", "source": "unit", "messages": [
            {"role": "user", "content": f"Question {i}: {text}?"},
            {"role": "assistant", "content": f"Answer {i}: {text[::-1]}"}]})
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    path = d / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    metrics = train_tokenizer(TokenizerOptions(inputs=[str(corpus)], vocab_size=400), out)
    return out, metrics


def test_record_texts_walks_nested_strings_and_skips_keys():
    rec = {"id": "x", "b": [{"role": "user", "content": "hi"}], "a": "first", "n": 3, "source": "s"}
    assert list(record_texts(rec, frozenset({"id", "source"}))) == ["user", "hi", "first"]


def test_special_tokens_are_template_markers_plus_bos_eos_pad():
    opts = TokenizerOptions(inputs=["x"], special_tokens=["<tool>"])
    src = "{{ '<|im_start|>' + m + '<|im_end|>' }}{{ '<|eot_id|>' }}"
    assert special_tokens_for(opts, src) == ["<|begin_of_text|>", "<|im_end|>", "<|pad|>", "<|im_start|>",
                                             "<|eot_id|>", "<tool>"]


def test_autotokenizer_and_astrai_agree(trained):
    from transformers import AutoTokenizer

    from astrai.text.tokenizer import load_tokenizer

    out, metrics = trained
    assert metrics["records"] == 200 and metrics["vocab_size"] == 400
    hf = AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(str(out))
    assert len(hf) == ours.tok.get_vocab_size() == 400
    for text in SAMPLES:
        for special in (True, False):
            assert hf(text, add_special_tokens=special)["input_ids"] == \
                ours.tok.encode(text, add_special_tokens=special).ids, (text, special)
        assert hf.decode(hf(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: lossless
    # bos starts a plain encode (pretraining documents); nothing is appended
    ids = hf("the cat")["input_ids"]
    assert ids[0] == hf.bos_token_id and ids[-1] != hf.eos_token_id
    # every special is one token, in both loaders
    for token in ("<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|pad|>"):
        assert hf(f"a{token}b", add_special_tokens=False)["input_ids"][1] == hf.convert_tokens_to_ids(token)
        assert ours.tok.token_to_id(token) == hf.convert_tokens_to_ids(token)
        assert ours.tok.token_to_id(token) in ours.special_ids
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")
    assert ours.special_tokens_map == {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>",
                                       "pad_token": "<|pad|>"}


def test_chat_template_renders_as_in_transformers(trained):
    from transformers import AutoTokenizer

    from astrai.text.template import ChatTemplate
    from astrai.text.tokenizer import load_tokenizer

    out, _ = trained
    hf = AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(str(out))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat?"},
            {"role": "assistant", "content": "sat on a mat"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nthe cat?<|im_end|>\n"
                "<|im_start|>assistant\nsat on a mat<|im_end|>\n<|im_start|>assistant\n")
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert ChatTemplate(ours.chat_template, "t").render(msgs, add_generation_prompt=True) == expected
    ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == ours.tok.encode(expected, add_special_tokens=False).ids
    assert ids.count(hf.convert_tokens_to_ids("<|im_start|>")) == 4


def test_same_data_same_bytes_whatever_the_threads(corpus, tmp_path, trained):
    out, _ = trained
    again = tmp_path / "again"
    train_tokenizer(TokenizerOptions(inputs=[str(corpus)], vocab_size=400), again)
    one_thread = tmp_path / "one"
    code = ("from astrai.recipe.tokenizer import TokenizerOptions, train_tokenizer; import sys; "
            "train_tokenizer(TokenizerOptions(inputs=[sys.argv[1]], vocab_size=400), sys.argv[2])")
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-c", code, str(corpus), str(one_thread)], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        ref = (out / name).read_bytes()
        assert (again / name).read_bytes() == ref
        assert (one_thread / name).read_bytes() == ref
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_different_data_different_vocab(corpus, tmp_path, trained):
    out, _ = trained
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"zebra xylophone quartz {i} " * 3}) + "\n" for i in range(100)))
    train_tokenizer(TokenizerOptions(inputs=[str(other)], vocab_size=400), tmp_path / "o")
    assert (tmp_path / "o" / "tokenizer.json").read_bytes() != (out / "tokenizer.json").read_bytes()


def test_bad_record_is_located(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2"):
        train_tokenizer(TokenizerOptions(inputs=[str(bad)], vocab_size=300), tmp_path / "t")


def test_missing_input_and_unknown_option(tmp_path):
    with pytest.raises(InputError):
        train_tokenizer(TokenizerOptions(inputs=[str(tmp_path / "nope.jsonl")], vocab_size=300), tmp_path / "t")
    with pytest.raises(Exception, match="vocab_sise"):
        TokenizerOptions(inputs=["x"], vocab_sise=3)


def test_preprocess_with_the_trained_tokenizer_verifies_every_mask(trained, corpus, tmp_path):
    """The trained tokenizer feeds preprocessing: exact masks on chat records, nothing rejected."""
    from astrai.config import Pipeline
    from astrai.data.preprocess import run_preprocess

    out, _ = trained
    pipe = Pipeline.model_validate({
        "version": 1, "tokenizer": str(out), "chat_template": "tokenizer",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "mask": {"user": "mask", "assistant": "train"}, "mask_default": "mask",
        "preprocessing": {"max_seq_len": 512}})
    stats = run_preprocess(pipe, [str(corpus)], str(tmp_path / "data"), workers=1, log=lambda m: None)
    assert stats["records_kept"] == 200 and stats["records_rejected"] == 0
    assert 0 < stats["trained_tokens"] < stats["tokens"]
