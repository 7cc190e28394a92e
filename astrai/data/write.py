"""Parquet shards, atomically: written under a temporary name and renamed when complete.

Row schema (DESIGN.md): input_ids, labels (omitted only for unpacked plain pretraining; packed rows
always carry them, IGNORE_INDEX at each document's first position), position_ids (unless
position_ids_mode none), seq_lens — all list<int32>, one row per bin (or per document unpacked).
Multi-output rows carry `{source}_input_ids` / `{source}_labels` (list<int32>, or
list<list<int32>> for list sources) and value columns (numbers as float32, never truncated to
integers).

Output is deterministic: the same rows give the same bytes (no timestamps in the file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from astrai.runtime import fresh_tmp, fsync_replace, tmp_name
from astrai.schema import IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS, SEQ_LENS, arrow_value_type

I32 = pa.list_(pa.int32())


def positions(seq_lens: np.ndarray, mode: str) -> Optional[np.ndarray]:
    """Position ids for a row made of documents of the given lengths."""
    total = int(seq_lens.sum())
    if mode == "none":
        return None
    if mode == "continuous":
        return np.arange(total, dtype=np.int32)
    # doc_reset: 0..n-1 per document, vectorized: arange minus each document's start offset
    starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    return (np.arange(total, dtype=np.int64) - starts).astype(np.int32)


def concat(arrays) -> np.ndarray:
    return np.concatenate(arrays) if len(arrays) else np.zeros(0, np.int32)


def rows_columns(ids: list, labels: Optional[list], seq_lens: np.ndarray, row_offsets: np.ndarray,
                 position_mode: str, with_seq_lens: bool = True, packed: bool = False) -> dict:
    """The token columns of rows made of documents (or document pieces), in order.

    ids/labels: each document's token arrays; seq_lens: their lengths; row_offsets (n_rows + 1):
    row r holds documents row_offsets[r]:row_offsets[r+1]. Both the streaming writer and the packed
    shard writer build their rows here, so the two layouts cannot drift apart.

    packed: the rows are packed bins, read by trainers that know nothing of seq_lens. Labels are
    then always written (ids where there are none), with IGNORE_INDEX at each document's (piece's)
    first position, as transformers' DataCollatorWithFlattening does: labels are shifted inside
    the model, so that position would otherwise teach the previous document's last token to
    predict this one's first.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    ends = np.concatenate([[0], np.cumsum(seq_lens)])
    row_lens = ends[row_offsets[1:]] - ends[row_offsets[:-1]]
    flat_ids = concat(ids)
    cols = {INPUT_IDS: list_array(flat_ids, row_lens)}
    if packed:
        flat_labels = concat(labels) if labels is not None else flat_ids.copy()
        flat_labels[ends[:-1][seq_lens > 0]] = IGNORE_INDEX
        cols[LABELS] = list_array(flat_labels, row_lens)
    elif labels is not None:
        cols[LABELS] = list_array(concat(labels), row_lens)
    if position_mode == "doc_reset":  # restarts per document, whatever the rows
        cols[POSITION_IDS] = list_array(positions(seq_lens, "doc_reset"), row_lens)
    elif position_mode == "continuous":  # restarts per row: a row is one "document" here
        cols[POSITION_IDS] = list_array(positions(row_lens, "doc_reset"), row_lens)
    if with_seq_lens:
        cols[SEQ_LENS] = list_array(seq_lens, np.diff(row_offsets))
    return cols


def trained_count(table: pa.Table) -> int:
    """The trained tokens of single-output rows as a trainer sees them: labels != IGNORE_INDEX (each
    packed piece's first position included, which rows_columns masks), or every token when no
    labels column is written. stats.json's trained_tokens is the sum of this over what was written."""
    if LABELS not in table.column_names:
        return sum(int(_list_offsets(c)[-1] - _list_offsets(c)[0]) for c in table.column(INPUT_IDS).chunks)
    return sum(int(np.count_nonzero(_list_values(c) != IGNORE_INDEX)) for c in table.column(LABELS).chunks)


def _list_offsets(chunk: pa.ListArray) -> np.ndarray:
    return np.frombuffer(chunk.buffers()[1], dtype=np.int32, count=len(chunk) + 1, offset=4 * chunk.offset)


def _list_values(chunk: pa.ListArray) -> np.ndarray:
    """A list<int32> chunk's values as numpy, read off its buffers (no copy)."""
    off, values = _list_offsets(chunk), chunk.values
    flat = np.frombuffer(values.buffers()[1], dtype=np.int32, count=len(values), offset=4 * values.offset)
    return flat[off[0]:off[-1]]


# Arrays and tables are built from numpy buffers with from_buffers/from_arrays: pa.array and
# pa.table check their input against pandas types, which imports pandas (0.5 s) in every process.

def int32_array(values: np.ndarray) -> pa.Array:
    v = np.ascontiguousarray(values, dtype=np.int32)
    return pa.Array.from_buffers(pa.int32(), len(v), [None, pa.py_buffer(v)])


def table_of(cols: dict) -> pa.Table:
    return pa.Table.from_arrays(list(cols.values()), names=list(cols))


def list_array(values: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """list<int32> from flat values and per-row lengths, without Python loops."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(int32_array(offsets), int32_array(values))


def nested_list_array(values: np.ndarray, inner_lengths: np.ndarray, outer_counts: np.ndarray) -> pa.Array:
    inner = list_array(values, inner_lengths)
    offsets = np.zeros(len(outer_counts) + 1, dtype=np.int32)
    np.cumsum(outer_counts, out=offsets[1:])
    return pa.ListArray.from_arrays(int32_array(offsets), inner)


def value_array(vals: list, value_type: str, per_item: bool) -> pa.Array:
    """A value column of its declared type (float is float32: a reward of 0.8 never becomes 0);
    per_item: one value per list item (GRPO completions), so a list of that type."""
    return pa.array(vals, arrow_value_type(value_type, per_item))


class ShardWriter:
    """Writes row groups to `name.tmp-<pid>` and renames to `name` on close (never a half shard)."""

    def __init__(self, path: Path, row_group_rows: int):
        self.path = Path(path)
        self.tmp = tmp_name(self.path)
        self.row_group_rows = row_group_rows
        self._writer: Optional[pq.ParquetWriter] = None
        self.rows = 0

    def write(self, table: pa.Table):
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(fresh_tmp(self.path), table.schema, compression="zstd", write_statistics=False,
                                            store_schema=True)
        self._writer.write_table(table, row_group_size=self.row_group_rows)
        self.rows += table.num_rows

    def close(self):
        if self._writer is None:
            return
        self._writer.close()
        fsync_replace(self.tmp, self.path)
        self._writer = None

    def abort(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.tmp.unlink(missing_ok=True)


def json_line(obj: dict) -> str:
    """One JSONL line (with its newline) for rejects.jsonl that never fails to write: text stays
    readable (ensure_ascii off) unless it holds lone surrogates, which only \\u escapes can carry in
    UTF-8; a record too deeply nested to serialize is left out, with a note saying so."""
    try:
        line = json.dumps(obj, ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        obj = {k: v for k, v in obj.items() if k != "record"}
        obj["record_omitted"] = "the record is nested too deeply to write back"
        line = json.dumps(obj, ensure_ascii=False, default=str)
    if not line.isascii():
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            line = json.dumps(obj, ensure_ascii=True, default=str)
    return line + "\n"
