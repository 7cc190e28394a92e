"""Readers: every format, globs, partitions independent of workers, located bad input."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from astrai.errors import InputError, RecordError
from astrai.data.read import expand_inputs, plan_partitions, read_partition
from astrai.text.tokenizer import load_tokenizer


def read_all(paths, partition_bytes=1 << 20, batch_size=7):
    parts = plan_partitions(expand_inputs([str(p) for p in paths]), partition_bytes)
    return [(r, w) for p in parts for b in read_partition(p, batch_size) for r, w in b], parts


def test_jsonl_partitions_keep_line_numbers(tmp_path):
    f = tmp_path / "a.jsonl"
    lines = [json.dumps({"i": i, "pad": "x" * (i % 13)}) for i in range(500)]
    lines.insert(100, "")  # a blank line is not a record but still a line
    f.write_text("\n".join(lines) + "\n")
    whole, one = read_all([f], partition_bytes=1 << 30)
    split, many = read_all([f], partition_bytes=997)
    assert len(one) == 1 and len(many) > 10
    assert whole == split  # same records, same line numbers, whatever the partitioning
    assert [r["i"] for r, _ in split] == list(range(500))
    by_i = {r["i"]: int(w) for r, w in split}
    assert by_i[0] == 1 and by_i[99] == 100 and by_i[100] == 102 and by_i[499] == 501
    assert [p.name for p in many] == [f"p{i:05d}" for i in range(len(many))]


def test_bad_jsonl_lines_are_located(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"ok": 1}\n{"broken": \n[1, 2]\n{"s": "\xff\xfe"}\n')
    items, _ = read_all([f])
    assert items[0] == ({"ok": 1}, "1")
    kinds = [(r.reason, w) for r, w in items[1:]]
    assert kinds == [("invalid_json", "2"), ("not_an_object", "3"), ("invalid_utf8", "4")]
    assert all(isinstance(r, RecordError) for r, _ in items[1:])


@pytest.mark.parametrize("cut", [40, 61, 75])
@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_a_line_cut_short_is_reported_where_it_stops(tmp_path, cut, ending):
    # the column Python's decoder gives for the line as it is, not "column 1" of the next line its
    # line ending would make it look at; gz streams are read the same way
    import gzip

    line = json.dumps({"messages": [{"role": "user", "content": "hello there"},
                                    {"role": "assistant", "content": "general kenobi"}]})[:cut]
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(line)
    want = f"invalid JSON: {e.value.msg} (column {e.value.colno})"
    assert e.value.colno > 1
    (tmp_path / "a.jsonl").write_text('{"ok": 1}\n' + line + ending, newline="")
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as fh:
        fh.write(('{"ok": 1}\n' + line + ending).encode())
    for name in ("a.jsonl", "b.jsonl.gz"):
        items, _ = read_all([tmp_path / name])
        assert (items[1][0].detail, items[1][1]) == (want, "2")


def test_json_object_list_parquet_and_hf_dir(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps({"text": "a"}))
    (tmp_path / "many.json").write_text(json.dumps([{"text": "b"}, 5, {"text": "c"}]))
    table = pa.table({"text": [f"r{i}" for i in range(50)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=10)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["h0", "h1", "h2"]}).save_to_disk(str(tmp_path / "hf"))
    items, _ = read_all([tmp_path / "one.json"])
    assert items == [({"text": "a"}, "record 0")]
    items, _ = read_all([tmp_path / "many.json"])
    assert items[0] == ({"text": "b"}, "record 0") and items[1][0].reason == "not_an_object"
    assert items[1][1] == "record 1" and items[2] == ({"text": "c"}, "record 2")
    items, parts = read_all([tmp_path / "t.parquet"], partition_bytes=1)
    assert len(parts) == 5 and [r["text"] for r, _ in items] == [f"r{i}" for i in range(50)]
    assert items[23][1] == "row 23"
    items, _ = read_all([tmp_path / "hf"])
    assert [r["text"] for r, _ in items] == ["h0", "h1", "h2"]


def test_hf_dataset_dirs_inside_a_directory(tmp_path):
    # A saved dataset inside a walked directory is read whole, from its Arrow files, never as its
    # metadata JSON; a DatasetDict (splits) is refused: which split to train on is the user's call.
    datasets = pytest.importorskip("datasets")
    root = tmp_path / "data"
    datasets.Dataset.from_dict({"text": ["h0", "h1"]}).save_to_disk(str(root / "hf"))
    (root / "z.jsonl").write_text(json.dumps({"text": "j0"}) + "\n")
    items, parts = read_all([root])
    assert [r["text"] for r, _ in items] == ["h0", "h1", "j0"]
    assert [p.kind for p in parts] == ["arrow", "jsonl"]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]}),
                                   "test": datasets.Dataset.from_dict({"text": ["b"]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match="DatasetDict.*train"):
        expand_inputs([str(tmp_path / "dd")])
    splits.save_to_disk(str(root / "dd"))
    with pytest.raises(InputError, match="DatasetDict"):
        expand_inputs([str(root)])
    assert [r["text"] for r, _ in read_all([tmp_path / "dd" / "train"])[0]] == ["a"]


def test_json_lines_in_a_json_file(tmp_path):
    # many datasets ship JSON Lines as .json (datasets' json loader reads both): one record per line,
    # never the whole file counted as one invalid record
    f = tmp_path / "lines.json"
    f.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"text": "b"}) + "\n{bad\n")
    items, _ = read_all([f])
    assert items[:2] == [({"text": "a"}, "1"), ({"text": "b"}, "3")]
    assert items[2][0].reason == "invalid_json" and items[2][1] == "4" and len(items) == 3


def test_globs_and_missing_inputs(tmp_path):
    for n in ("b", "a", "c"):
        (tmp_path / f"{n}.jsonl").write_text(json.dumps({"n": n}) + "\n")
    files = expand_inputs([str(tmp_path / "*.jsonl")])
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl", "c.jsonl"]
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(tmp_path / "*.parquet")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown format"):
        plan_partitions(expand_inputs([str(tmp_path / "x.csv")]), 1000)


def test_tokenizer_path_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(InputError, match="not installed"):
        load_tokenizer("package:no_such_tokenizer_pkg")


def test_tokenizer_matches_transformers_special_tokens(tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(str(tiny_tokenizer))
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    assert ours.special_tokens_map["bos_token"] == hf.bos_token == "<s>"
    text = "<s>hello world</s> the quick<|im_end|>"
    assert ours.tok.encode(text, add_special_tokens=False).ids == hf(text, add_special_tokens=False)["input_ids"]


def test_utf8_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"a": 2}\n')
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf[{"a": 3}]')
    items, _ = read_all([tmp_path / "bom.jsonl", tmp_path / "bom.json"])
    assert [r for r, _ in items] == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_partition_planning_hashes_each_jsonl_in_the_same_pass(tmp_path):
    """The digests taken while planning equal a plain sha256 of the file, for any partition size."""
    import hashlib
    import random

    rng = random.Random(0)
    for n_lines, tail in ((0, b""), (1, b""), (400, b""), (999, b'{"no": "newline at end"}')):
        f = tmp_path / f"f{n_lines}.jsonl"
        f.write_bytes(b"".join(b'{"x": %d}\n' % rng.randint(0, 10 ** rng.randint(0, 30)) for _ in range(n_lines))
                      + tail)
        for partition_bytes in (1, 7, 1000, 1 << 30):
            digests = {}
            plan_partitions([f], partition_bytes, digests)
            assert digests[str(f)] == hashlib.sha256(f.read_bytes()).hexdigest(), (n_lines, partition_bytes)
