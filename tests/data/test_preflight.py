"""Preflight: template markers must be single tokens; too many rejects (or none kept) fail the run."""

import json
import sys
from pathlib import Path

import pytest

from astrai.config import Pipeline
from astrai.errors import InputError
from astrai.data.preprocess import run_preprocess

sys.path.insert(0, str(Path(__file__).parent))
from test_preprocess import chat_records, pipeline  # noqa: E402


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """A byte-level BPE that knows <s> and </s> but not chatml's <|im_start|>/<|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world how are you today assistant user system"] * 50, trainer)
    path = tmp_path_factory.mktemp("plain")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def test_markers_missing_from_the_tokenizer_fail_before_any_work(tmp_path, plain_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(20))
    out = tmp_path / "o"
    with pytest.raises(InputError, match=r"'<\|im_start\|>', '<\|im_end\|>' are not single tokens.*"
                                         r"added_tokens: \[<\|im_start\|>, <\|im_end\|>\]"):
        run_preprocess(pipeline(), [str(data)], str(out), tokenizer=str(plain_tokenizer), workers=1,
                       log=lambda s: None)
    assert not out.exists() or not any(out.iterdir())  # nothing was written
    # the fix the message names works
    pipe = pipeline().model_copy(update={"added_tokens": ["<|im_start|>", "<|im_end|>"]})
    stats = run_preprocess(pipe, [str(data)], str(out), tokenizer=str(plain_tokenizer), workers=1, log=lambda s: None)
    assert stats["records_kept"] == 20


def test_llama2_style_plain_text_markers_are_not_required_tokens():
    from astrai.data.preflight import template_markers
    from astrai.text.template import ChatTemplate

    src = ("{% for m in messages %}{% if m.role == 'user' %}{{ bos_token }}[INST] <<SYS>>x<</SYS>> {{ m.content }} "
           "[/INST]{% else %} {{ m.content }} {{ eos_token }}{% endif %}{% endfor %}")
    assert set(template_markers(ChatTemplate(src, "l2"), {"bos_token": "<s>", "eos_token": "</s>"}, {})) == {"<s>", "</s>"}


def test_too_many_rejects_fail_with_reasons_and_no_manifest(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(30, bad_every=3))  # a third is bad
    out = tmp_path / "o"
    stats = run_preprocess(pipeline(), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)  # default share 0.5: passes
    assert stats["records_rejected"] == 10
    strict = pipeline(max_reject_share=0.2)
    for _ in range(2):  # the rerun fails again rather than reading as up to date
        with pytest.raises(InputError, match=r"10 of 30 records were rejected.*max_reject_share 0.2.*rejects.jsonl"):
            run_preprocess(strict, [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
        assert not (out / "manifest.json").exists() and (out / "rejects.jsonl").exists()


def test_a_run_that_keeps_nothing_fails(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": []}\n' * 5)
    with pytest.raises(InputError, match="no record was kept"):
        run_preprocess(pipeline(max_reject_share=1.0), [str(data)], str(tmp_path / "o"),
                       tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)


def test_max_reject_share_is_validated():
    with pytest.raises(Exception, match="max_reject_share"):
        Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text"}]},
                                 "preprocessing": {"max_reject_share": 2}})
