"""The held-out split is made while reading the user's files: each side reads exactly its records,
by their position over all input files, and every reject names the user's file and line."""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from astrai.data.holdout import Holdout, is_held_out
from astrai.data.preprocess import run_preprocess
from astrai.data.process import Processor, RecordOutput
from astrai.text.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from test_preprocess import pipeline  # noqa: E402


def test_held_out_positions_are_spread_evenly():
    assert [i for i in range(40) if is_held_out(i, 0.1)] == [9, 19, 29, 39]
    assert [i for i in range(6) if is_held_out(i, 0.5)] == [1, 3, 5]
    assert not any(is_held_out(i, 0.0) for i in range(10))


def chat(i):
    return {"messages": [{"role": "user", "content": f"question {i} how are you"},
                         {"role": "assistant", "content": f"fine {i} thanks " * (1 + i % 3)}]}


@pytest.fixture
def inputs(tmp_path):
    """Three JSONL files (with a blank line, a bad line and no final newline), a JSON list and a
    Parquet file: each position's record, or None where the position holds no record."""
    slots = []  # (file, where, record-or-None-or-"bad")
    files = []
    n = 0
    for k in range(3):
        f = tmp_path / f"part{k}.jsonl"
        lines = []
        for line in range(1, 8):
            if (k, line) == (0, 3):
                lines.append("")  # blank: a position, not a record
                slots.append((f, str(line), None))
            elif (k, line) == (1, 3):  # position 9: held out at 0.1, trained at 0.25
                lines.append("{not json")
                slots.append((f, str(line), "bad"))
            else:
                lines.append(json.dumps(chat(n)))
                slots.append((f, str(line), chat(n)))
                n += 1
        f.write_text("\n".join(lines) + ("\n" if k != 1 else ""))  # part1 ends without a newline
        files.append(f)
    recs = [chat(n + j) for j in range(5)]
    (tmp_path / "list.json").write_text(json.dumps(recs))
    slots += [(tmp_path / "list.json", f"record {j}", r) for j, r in enumerate(recs)]
    n += 5
    rows = [chat(n + j) for j in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=4)
    slots += [(tmp_path / "rows.parquet", f"row {j}", r) for j, r in enumerate(rows)]
    return [str(f) for f in files] + [str(tmp_path / "list.json"), str(tmp_path / "rows.parquet")], slots


@pytest.mark.parametrize("share", [0.1, 0.25])
def test_each_side_reads_exactly_its_positions(tmp_path, tiny_tokenizer, inputs, share):
    paths, slots = inputs
    pipe = pipeline(packing_strategy="none", partition_bytes=200)  # several partitions per file
    pr = Processor(pipe, load_tokenizer(str(tiny_tokenizer)))
    for side in ("train", "val"):
        out = tmp_path / side
        stats = run_preprocess(pipe, paths, str(out), tokenizer=str(tiny_tokenizer), workers=2,
                               log=lambda s: None, holdout=Holdout(share, side))
        mine = [(f, w, r) for i, (f, w, r) in enumerate(slots) if is_held_out(i, share) == (side == "val")]
        records = [r for _, _, r in mine if isinstance(r, dict)]
        bad = [(f, w) for f, w, r in mine if r == "bad"]
        assert stats["records_read"] == len(records) + len(bad)
        rows = [r for f in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
        want = [pr.process_one(r) for r in records]
        assert [r["input_ids"] for r in rows] == [w.seq().input_ids.tolist() for w in want
                                                  if isinstance(w, RecordOutput)]
        rejects = [json.loads(line) for line in (out / "rejects.jsonl").open()] if bad else []
        assert [(r["file"], r["line"]) for r in rejects] == [(str(f), w) for f, w in bad]  # the user's file:line
        man = json.loads((out / "manifest.json").read_text())
        assert man["holdout"] == {"share": share, "side": side}
    # the two sides and a run without a split are three different outputs
    assert json.loads((tmp_path / "train" / "manifest.json").read_text())["fingerprint"] != \
        json.loads((tmp_path / "val" / "manifest.json").read_text())["fingerprint"]
