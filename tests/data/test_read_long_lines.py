"""Input lines past preprocessing.max_record_bytes (astrai.data.lines, read): a located reject under
on_error: skip, a located error under raise, never read whole, and the lines after it keep their
numbers, in plain, gzip and zstd JSONL and in JSON Lines inside a .json file."""

import gzip
import json
import tracemalloc

import pytest

from astrai.config import Pipeline
from astrai.data.lines import LongLine, bounded_lines
from astrai.data.preprocess import run_preprocess
from astrai.data.read import expand_inputs, plan_partitions, read_partition
from astrai.errors import RecordError

CHAT = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]}
LIMIT = 4096


def lines_with_a_long_one(long_bytes: int = 50_000) -> bytes:
    big = {"messages": [{"role": "user", "content": "x" * long_bytes}, CHAT["messages"][1]]}
    at_limit = json.dumps({"messages": [{"role": "user", "content": ""}, CHAT["messages"][1]], "i": 5})
    at_limit = at_limit.replace('"content": ""', '"content": "' + "y" * (LIMIT - len(at_limit)) + '"', 1)
    assert len(at_limit) == LIMIT
    rows = [json.dumps({**CHAT, "i": 1}), "", json.dumps(big), json.dumps({**CHAT, "i": 4}), at_limit]
    return ("\n".join(rows) + "\n").encode()


def write(tmp_path, kind: str, raw: bytes):
    if kind == "jsonl":
        f = tmp_path / "d.jsonl"
        f.write_bytes(raw)
    elif kind == "gz":
        f = tmp_path / "d.jsonl.gz"
        f.write_bytes(gzip.compress(raw, mtime=0))
    elif kind == "zst":
        zstandard = pytest.importorskip("zstandard")
        f = tmp_path / "d.jsonl.zst"
        f.write_bytes(zstandard.ZstdCompressor().compress(raw))
    else:
        f = tmp_path / "d.json"  # JSON Lines in a .json file
        f.write_bytes(raw)
    return f


def read_all(f, partition_bytes: int, max_record_bytes: int = LIMIT):
    parts = plan_partitions(expand_inputs([str(f)]), partition_bytes)
    return [(r, w) for p in parts for b in read_partition(p, 3, None, max_record_bytes) for r, w in b]


def test_bounded_lines_by_hand():
    import io

    raw = b"ab\n" + b"c" * 10 + b"\n" + b"d" * 4 + b"\n" + b"e" * 5 + b"\n" + b"f" * 9
    assert list(bounded_lines(io.BytesIO(raw), 4)) == [b"ab\n", LongLine(11), b"dddd\n", LongLine(6), LongLine(9)]
    assert list(bounded_lines(io.BytesIO(raw), 4, length=3 + 11)) == [b"ab\n", LongLine(11)]


@pytest.mark.parametrize("kind", ["jsonl", "gz", "zst", "json"])
@pytest.mark.parametrize("partition_bytes", [1 << 20, 100])  # 100: a partition boundary falls inside the long line
def test_a_long_line_is_a_located_reject_and_the_rest_keep_their_lines(tmp_path, kind, partition_bytes):
    f = write(tmp_path, kind, lines_with_a_long_one())
    items = read_all(f, partition_bytes)
    assert [w for _, w in items] == ["1", "3", "4", "5"]
    err = items[1][0]
    assert isinstance(err, RecordError) and err.reason == "record_too_large"
    assert f"more than preprocessing.max_record_bytes ({LIMIT:,})" in err.detail
    assert [r["i"] for r, _ in items if not isinstance(r, RecordError)] == [1, 4, 5]  # LIMIT itself is fine


def test_a_long_line_is_never_held_in_memory(tmp_path):
    f = tmp_path / "d.jsonl"
    with open(f, "wb") as fh:
        fh.write(json.dumps(CHAT).encode() + b"\n" + b"z" * (64 << 20) + b"\n" + json.dumps(CHAT).encode() + b"\n")
    tracemalloc.start()
    try:
        parts = plan_partitions([f], 1 << 20)  # partition planning seeks into the long line too
        items = [(r, w) for p in parts for b in read_partition(p, 3, None, 1 << 20) for r, w in b]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [w for _, w in items] == ["1", "2", "3"] and items[1][0].reason == "record_too_large"
    assert "67,108,865 bytes" in items[1][0].detail
    # planning counts newlines in 16 MiB blocks (and hashes them); a line read whole would add 64 MiB
    assert peak < 40 << 20, f"{peak:,} bytes traced: the 64 MiB line was read whole"


def pipe(on_error: str, max_record_bytes=None, **more):
    pre = {"on_error": on_error, **({"max_record_bytes": max_record_bytes} if max_record_bytes else {}), **more}
    return Pipeline.model_validate({
        "version": 1, "chat_template": "chatml",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": pre})


def test_preprocess_counts_it_under_skip_and_stops_with_file_line_under_raise(tmp_path, tiny_tokenizer):
    f = write(tmp_path, "jsonl", lines_with_a_long_one())
    stats = run_preprocess(pipe("skip", LIMIT), [str(f)], str(tmp_path / "skip"), tokenizer=str(tiny_tokenizer),
                           workers=1, log=lambda s: None)
    assert stats["records_read"] == 4 and stats["records_rejected"] == 1 and stats["records_kept"] == 3
    rejects = [json.loads(line) for line in (tmp_path / "skip" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rejects] == [(str(f), "3", "record_too_large")]
    with pytest.raises(RecordError, match=rf"d.jsonl:3: the line holds [\d,]+ bytes, more than "
                                          rf"preprocessing.max_record_bytes \({LIMIT:,}\)"):
        run_preprocess(pipe("raise", LIMIT), [str(f)], str(tmp_path / "raise"), tokenizer=str(tiny_tokenizer),
                       workers=1, log=lambda s: None)


def test_a_record_too_large_for_any_template_is_a_reject_not_the_end_of_the_run(tmp_path, tiny_tokenizer):
    # 20 MB of text, within the default max_record_bytes but past what a template may render in one value
    f = write(tmp_path, "jsonl", lines_with_a_long_one(20_000_000))
    stats = run_preprocess(pipe("skip"), [str(f)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)
    assert stats["records_rejected"] == 1 and stats["records_kept"] == 3
    reject = json.loads((tmp_path / "o" / "rejects.jsonl").read_text().splitlines()[0])
    assert (reject["line"], reject["reason"]) == ("3", "too_large")


def test_one_worker_and_two_give_the_same_bytes(tmp_path, tiny_tokenizer):
    f = write(tmp_path, "jsonl", lines_with_a_long_one() * 40)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        run_preprocess(pipe("skip", LIMIT, partition_bytes=4096), [str(f)], str(out), tokenizer=str(tiny_tokenizer),
                       workers=workers, log=lambda s: None)
        outs.append({q.name: q.read_bytes() for q in sorted((out / "data").iterdir())}
                    | {"rejects": (out / "rejects.jsonl").read_bytes()})
    assert outs[0] == outs[1] and outs[0]["rejects"].count(b"record_too_large") == 40


def test_validate_reads_with_the_pipelines_bound(tmp_path, tiny_tokenizer):
    from astrai.data.inspect.records import records_report

    f = write(tmp_path, "jsonl", lines_with_a_long_one())
    report = records_report("p.yaml", pipe("skip", LIMIT), str(tmp_path), str(tiny_tokenizer), [str(f)], [0, 1, 2, 3])
    assert report.stats["records_rejected"] == 1 and report.stats["rejected_by_reason"] == {"record_too_large": 1}
