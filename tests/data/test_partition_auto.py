"""`preprocessing.partition_bytes: auto` (the default): partitions sized from the inputs' total size,
so a dataset of a few MiB still gives every worker partitions to tokenize; the output is the same
bytes as with one partition."""

import os
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from astrai.data.preprocess import run_preprocess
from astrai.data.preprocess.run import AUTO_MAX, AUTO_MIN, partition_bytes

sys.path.insert(0, str(Path(__file__).parent))
from test_preprocess import chat_records, pipeline  # noqa: E402

MIB = 1 << 20


def sized(path, n):
    path.write_bytes(b"")
    os.truncate(path, n)  # sparse: only the size is read
    return path


@pytest.mark.parametrize("sizes, expected", [
    ([10_000], AUTO_MIN),  # a small dataset: partitions no smaller than 1 MiB
    ([200 * MIB], 200 * MIB // 64),  # 64 partitions
    ([100 * MIB, 100 * MIB + 1], -(-(200 * MIB + 1) // 64)),  # over all inputs, rounded up
    ([10 << 30], AUTO_MAX),  # a big one: no partition over 32 MiB
])
def test_auto_is_the_total_size_over_64_within_bounds(tmp_path, sizes, expected):
    files = [sized(tmp_path / f"f{i}.jsonl", n) for i, n in enumerate(sizes)]
    assert partition_bytes(files, "auto") == expected
    assert partition_bytes(files, 12345) == 12345  # a number is taken as given


def test_the_setting_takes_auto_or_a_positive_number():
    assert pipeline().preprocessing.partition_bytes == "auto"
    assert pipeline(partition_bytes=4096).preprocessing.partition_bytes == 4096
    for bad in (0, -1, "big"):
        with pytest.raises(ValidationError, match="partition_bytes"):
            pipeline(partition_bytes=bad)


def test_auto_splits_a_few_mib_and_writes_what_one_partition_writes(tmp_path, tiny_tokenizer):
    data = tmp_path / "in.jsonl"
    data.write_text(chat_records(2800, seed=3))
    size = data.stat().st_size
    assert 2 * MIB < size < 3 * MIB
    lines: list[str] = []
    outs = {}
    for setting in ("auto", 32 * MIB):
        out = tmp_path / f"o-{setting}"
        run_preprocess(pipeline(packing_strategy="bfd", max_packed_len=512, partition_bytes=setting), [str(data)],
                       str(out), tokenizer=str(tiny_tokenizer), workers=2, log=lines.append)
        outs[setting] = out
    # auto: 3 partitions on 2 workers; 32 MiB: one, which the parent tokenizes alone (no pool, no line)
    assert [line for line in lines if "partitions done" in line] == ["3 partitions done with 2 workers"], lines
    assert _data_and_stats(outs["auto"]) == _data_and_stats(outs[32 * MIB])


def _data_and_stats(out):
    return {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*"))
            if f.is_file() and (f.parent.name == "data" or f.name == "stats.json")}
