"""Inputs: skipped files in a directory are listed, .jsonl.gz / .jsonl.zst are read
streamed with the right line numbers, an empty file or directory warns."""

import gzip
import json

import pytest

from astrai.config import Pipeline
from astrai.errors import InputError, RecordError
from astrai.data.preprocess import run_preprocess
from astrai.data.read import expand_inputs, plan_partitions, read_partition

CHAT = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]}


def pipe(on_error="skip"):
    return Pipeline.model_validate({
        "version": 1, "chat_template": "chatml",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": {"on_error": on_error}})


def jsonl_text(n=12, bad_at=(7,)):
    lines = []
    for i in range(1, n + 1):
        lines.append("{broken" if i in bad_at else "" if i == 4 else json.dumps({**CHAT, "i": i}))
    return ("\n".join(lines) + "\n").encode()


def compress(kind, raw):
    if kind == "gz":
        return gzip.compress(raw, mtime=0)
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(raw)


def test_skipped_files_in_a_directory_are_listed(tmp_path, tiny_tokenizer):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text(json.dumps(CHAT) + "\n")
    (d / "sub" / "b.jsonl").write_text(json.dumps(CHAT) + "\n")
    (d / "README.md").write_text("# data\n")
    (d / "sub" / "notes.txt").write_text("x\n")
    warnings = []
    files = expand_inputs([str(d)], warnings=warnings)
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl"]
    assert len(warnings) == 1 and "README.md" in warnings[0] and "sub/notes.txt" in warnings[0]
    logs = []
    run_preprocess(pipe(), [str(d)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1, log=logs.append)
    assert any(l.startswith("warning:") and "README.md" in l for l in logs)


def test_empty_file_and_empty_directory_warn(tmp_path, tiny_tokenizer):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "nothing").mkdir()
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(CHAT) + "\n")
    logs = []
    stats = run_preprocess(pipe(), [str(tmp_path / "empty.jsonl"), str(tmp_path / "nothing"), str(good)],
                           str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1, log=logs.append)
    assert stats["records_kept"] == 1
    warns = [l for l in logs if l.startswith("warning:")]
    assert any("empty.jsonl" in w and "empty" in w for w in warns)
    assert any("nothing" in w and "no input files" in w for w in warns)


def test_nothing_to_read_at_all_is_still_an_error(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "README.md").write_text("x")
    with pytest.raises(InputError, match="no input"):
        expand_inputs([str(tmp_path / "d")], warnings=[])


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_compressed_jsonl_is_read_with_line_numbers(tmp_path, tiny_tokenizer, kind):
    raw = jsonl_text()
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(raw)
    packed = tmp_path / f"data.jsonl.{kind}"
    packed.write_bytes(compress(kind, raw))
    parts = plan_partitions(expand_inputs([str(packed)]), 64)  # one partition: a stream cannot be split
    items = [(r, w) for p in parts for b in read_partition(p, 5) for r, w in b]
    ref_parts = plan_partitions(expand_inputs([str(plain)]), 1 << 20)
    ref = [(r, w) for p in ref_parts for b in read_partition(p, 5) for r, w in b]
    assert len(parts) == 1
    assert [w for _, w in items] == [w for _, w in ref] == [str(i) for i in range(1, 13) if i != 4]
    assert [r for r, _ in items if not isinstance(r, RecordError)] == [r for r, _ in ref if not isinstance(r, RecordError)]
    out = tmp_path / "o"
    stats = run_preprocess(pipe(), [str(packed)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)
    rej = json.loads((out / "rejects.jsonl").read_text())
    assert stats["records_read"] == 11 and (rej["file"], rej["line"], rej["reason"]) == (str(packed), "7", "invalid_json")
    with pytest.raises(RecordError, match=rf"data.jsonl.{kind}:7:"):
        run_preprocess(pipe("raise"), [str(packed)], str(tmp_path / "o2"), tokenizer=str(tiny_tokenizer), workers=1,
                       log=lambda s: None)


def test_compressed_inputs_in_a_directory_are_found(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl.gz").write_bytes(compress("gz", jsonl_text(3, ())))
    (d / "b.jsonl").write_bytes(jsonl_text(2, ()))
    warnings = []
    assert [f.name for f in expand_inputs([str(d)], warnings=warnings)] == ["a.jsonl.gz", "b.jsonl"]
    assert warnings == []


def test_truncated_gzip_names_the_file(tmp_path, tiny_tokenizer):
    f = tmp_path / "cut.jsonl.gz"
    f.write_bytes(compress("gz", jsonl_text(200, ()))[:-30])
    with pytest.raises(InputError, match="cut.jsonl.gz"):
        run_preprocess(pipe(), [str(f)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                       log=lambda s: None)
