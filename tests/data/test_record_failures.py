"""No single record aborts a run: each failure is a located reject (skip) or a located error (raise),
and an unreadable input file is an error that names it."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from astrai.config import Pipeline, load_pipeline
from astrai.errors import InputError, RecordError
from astrai.data.preprocess import run_preprocess

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]}


def chat_pipe(on_error="skip", **kw):
    return Pipeline.model_validate({
        "version": 1, "chat_template": "chatml", **kw,
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": {"on_error": on_error}})


def run(tmp_path, pipe, lines, tok, name="d.jsonl"):
    f = tmp_path / name
    f.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    out = tmp_path / f"out-{pipe.preprocessing.on_error}"
    stats = run_preprocess(pipe, [str(f)], str(out), tokenizer=str(tok), workers=1, log=lambda s: None)
    rejects = [json.loads(l) for l in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()] \
        if (out / "rejects.jsonl").exists() else []
    return f, out, stats, rejects


def bad_lines():
    deep = '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}"
    almost_deep = {"messages": CHAT["messages"], "extra": json.loads("[" * 900 + "]" * 900)}
    surrogate = json.dumps({"messages": [{"role": "user", "content": "hi \ud800 there"},
                                         {"role": "assistant", "content": "ok"}]})  # json escapes it: \\ud800
    surrogate_answer = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "x\udfffy"}]})
    return [json.dumps(CHAT), deep, json.dumps(almost_deep), surrogate, surrogate_answer, json.dumps(CHAT)]


def test_pathological_records_are_located_rejects_in_skip_mode(tmp_path, tiny_tokenizer):
    f, out, stats, rejects = run(tmp_path, chat_pipe(), bad_lines(), tiny_tokenizer)
    assert stats["records_read"] == 6 and stats["records_kept"] + stats["records_rejected"] == 6
    by_line = {r["line"]: r for r in rejects}
    assert by_line["2"]["reason"] == "too_deep" and by_line["2"]["file"] == str(f)
    assert by_line["4"]["reason"] == "invalid_unicode" and by_line["4"]["key"] == "messages[0].content"
    assert by_line["5"]["reason"] == "invalid_unicode" and by_line["5"]["key"] == "messages[1].content"
    assert "3" not in by_line  # deep but parseable and unused: processed normally
    assert stats["records_kept"] == 3
    # rejects.jsonl is valid UTF-8 JSON and keeps the record (the surrogate escaped, not lost)
    assert by_line["4"]["record"]["messages"][0]["content"] == "hi \ud800 there"


def test_pathological_records_are_located_errors_in_raise_mode(tmp_path, tiny_tokenizer):
    lines = bad_lines()
    for bad in (1, 3, 4):
        with pytest.raises(RecordError) as e:
            run(tmp_path, chat_pipe("raise"), [lines[0], lines[bad]], tiny_tokenizer, name=f"r{bad}.jsonl")
        assert f"r{bad}.jsonl:2:" in str(e.value) and e.value.reason in ("too_deep", "invalid_unicode")


def test_lone_surrogate_in_plain_text_section(tmp_path, tiny_tokenizer):
    pipe = Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text", "action": "train"}]},
                                    "preprocessing": {"on_error": "skip"}})
    lines = [json.dumps({"text": "good text"}), json.dumps({"text": "bad \udc80 text"})]
    _, _, stats, rejects = run(tmp_path, pipe, lines, tiny_tokenizer)
    assert stats["records_kept"] == 1 and [(r["line"], r["reason"], r["key"]) for r in rejects] == \
        [("2", "invalid_unicode", "text")]


def grpo_line(*rewards):
    return json.dumps({"prompt": [{"role": "user", "content": "say yes"}],
                       "completions": [{"text": "yes", "reward": r} for r in rewards]})


def test_non_finite_and_out_of_range_rewards_are_rejected(tmp_path, tiny_tokenizer):
    # most lines are bad on purpose: no reject-share limit here
    pipe = load_pipeline(ROOT / "pipelines" / "grpo_chatml.yaml",
                         ("preprocessing.on_error=skip", "preprocessing.max_reject_share=1.0"))
    lines = [grpo_line(0.8, 1), grpo_line(float("nan"), 1), grpo_line(0.5, float("inf")),
             grpo_line(float("-inf")), grpo_line(1e39), grpo_line(-3.5e38), grpo_line(3.4e38), grpo_line(10 ** 400)]
    _, out, stats, rejects = run(tmp_path, pipe, lines, tiny_tokenizer)
    reasons = {r["line"]: (r["reason"], r["key"]) for r in rejects}
    assert reasons == {"2": ("non_finite", "completions[0].reward"), "3": ("non_finite", "completions[1].reward"),
                       "4": ("non_finite", "completions[0].reward"), "5": ("out_of_range", "completions[0].reward"),
                       "6": ("out_of_range", "completions[0].reward"), "8": ("out_of_range", "completions[0].reward")}
    rewards = [v for f in sorted((out / "data").glob("*.parquet")) for row in pq.read_table(f).column("rewards").to_pylist()
               for v in row]
    assert len(rewards) == 3 and all(math.isfinite(v) for v in rewards)
    assert np.float32(rewards[-1]) == np.float32(3.4e38)


def test_int_value_out_of_int64_is_rejected(tmp_path, tiny_tokenizer):
    pipe = Pipeline.model_validate({"version": 1, "input": {"sections": [
        {"field": "text", "action": "train"}, {"field": "n", "action": "value", "value_type": "int"}]},
        "preprocessing": {"on_error": "skip"}})
    lines = [json.dumps({"text": "a b", "n": 3}), json.dumps({"text": "a b", "n": 2 ** 63}),
             json.dumps({"text": "a b", "n": -(2 ** 63)})]
    _, _, stats, rejects = run(tmp_path, pipe, lines, tiny_tokenizer)
    assert stats["records_kept"] == 2 and [(r["line"], r["reason"]) for r in rejects] == [("2", "out_of_range")]


def test_string_value_with_a_lone_surrogate_is_rejected(tmp_path, tiny_tokenizer):
    pipe = Pipeline.model_validate({"version": 1, "input": {"sections": [
        {"field": "text", "action": "train"}, {"field": "s", "action": "value", "value_type": "string"}]},
        "preprocessing": {"on_error": "skip"}})
    lines = [json.dumps({"text": "a b", "s": "ok"}), json.dumps({"text": "a b", "s": "\ud834"})]
    _, _, stats, rejects = run(tmp_path, pipe, lines, tiny_tokenizer)
    assert stats["records_kept"] == 1 and [(r["line"], r["reason"], r["key"]) for r in rejects] == \
        [("2", "invalid_unicode", "s")]


def _parquet(path, n=50):
    pq.write_table(pa.table({"text": [f"hello world {i}" for i in range(n)]}), path, row_group_size=10)


@pytest.mark.parametrize("damage", ["footer", "truncated", "garbage", "row_group"])
def test_corrupt_parquet_names_the_file(tmp_path, tiny_tokenizer, damage):
    f = tmp_path / "in.parquet"
    _parquet(f)
    raw = bytearray(f.read_bytes())
    if damage == "footer":
        raw[-4:] = b"XXXX"
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage":
        raw = bytearray(b"not a parquet file at all")
    else:  # data pages overwritten, footer intact
        raw[8:200] = bytes(192)
    f.write_bytes(bytes(raw))
    pipe = Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text", "action": "train"}]},
                                    "preprocessing": {"on_error": "skip"}})
    with pytest.raises(InputError) as e:
        run_preprocess(pipe, [str(f)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                       log=lambda s: None)
    assert str(f) in str(e.value)


def test_truncated_jsonl_last_line_is_a_located_reject(tmp_path, tiny_tokenizer):
    text = json.dumps(CHAT) + "\n" + json.dumps(CHAT)[:20]
    f = tmp_path / "t.jsonl"
    f.write_text(text)
    out = tmp_path / "o"
    stats = run_preprocess(chat_pipe(), [str(f)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)
    rej = json.loads((out / "rejects.jsonl").read_text())
    assert stats["records_kept"] == 1 and (rej["line"], rej["reason"]) == ("2", "invalid_json")


def test_unreadable_input_names_the_file(tmp_path, tiny_tokenizer):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    f = tmp_path / "locked.jsonl"
    f.write_text(json.dumps(CHAT) + "\n")
    f.chmod(0)
    with pytest.raises(InputError, match="locked.jsonl"):
        run_preprocess(chat_pipe(), [str(f)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                       log=lambda s: None)
