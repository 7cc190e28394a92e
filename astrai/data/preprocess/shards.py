"""Sinks of the tokenize pass: where one partition's kept records go.

- `ShardSink`: rows straight to the partition's own shards `data/part-PPPPP-KKKK.parquet`:
  one row per record (packing none, and multi-output), or next-fit bins (packing simple). Rows
  are written a row group at a time; a new shard starts once a shard holds max_tokens_per_shard.
  Memory is one batch plus one row group.
- `IntermediateSink`: global packing (bfd, bfd_split) needs every document's length before any
  bin is known, so documents go to flat token files `.work/PPPPP.input_ids.bin` / `.labels.bin` (read a
  piece at a time by the packing pass) and their lengths to `.work/PPPPP.lengths.npy`.

Simple packing is planned by astrai.data.packing.plan_bins("simple") like every strategy. It is
streamed: documents wait in `pending` until a chunk is planned; every bin but the last (still
open) is written, and the open bin's documents are planned again with the next chunk. Next-fit
restarted at a bin start gives the same bins, so the result is next-fit over the partition.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np

from astrai.data.packing import plan_bins
from astrai.data.preprocess.job import Job
from astrai.data.process import Processor, RecordOutput, TokenSeq
from astrai.data.read import Partition
from astrai.data.write import (ShardWriter, concat, list_array, nested_list_array, rows_columns, table_of,
                               trained_count, value_array)
from astrai.runtime import atomic_write_bytes, fresh_tmp
from astrai.schema import INPUT_IDS, LABELS, source_column

PLAN_CHUNK = 1024  # documents planned at once by the streamed simple packer


class ShardSink:
    def __init__(self, job: Job, part: Partition, proc: Processor):
        self.job, self.part, self.proc = job, part, proc
        self.o = job.pipeline.output
        self.pp = job.pipeline.preprocessing
        self.multi = job.pipeline.input.sources is not None
        self.rows: list = []  # rows of the next row group: RecordOutputs (multi-output) or (bin, values)
        self.pending: list[TokenSeq] = []  # simple packing: documents not yet in a closed bin
        self.plan_at = PLAN_CHUNK  # plan when this many are pending (an open bin can hold many)
        self.k = 0  # shard number within the partition
        self.writer: Optional[ShardWriter] = None
        self.shard_tokens = 0
        self.c = Counter()

    def add(self, out: RecordOutput):
        if self.multi:
            self._emit(out)
        elif self.pp.packing_strategy == "simple":
            self.pending.append(out.seq())
            if len(self.pending) >= self.plan_at:
                self._pack(final=False)
                self.plan_at = len(self.pending) + PLAN_CHUNK
        else:
            self._emit(([out.seq()], out.values))

    def _pack(self, final: bool):
        """Close the bins of the pending documents (all of them when final, else all but the open one)."""
        plan = plan_bins(np.array([len(s) for s in self.pending], dtype=np.int64), self.job.pipeline.bin_capacity,
                         "simple", self.pp.truncation_mode)
        closed = plan.n_bins if final else plan.n_bins - 1
        for b in range(closed):
            bin_ = []
            for p in range(plan.bin_offsets[b], plan.bin_offsets[b + 1]):
                seq = self.pending[plan.piece_doc[p]]
                start, n = int(plan.piece_start[p]), int(plan.piece_len[p])
                if n < len(seq):  # longer than a bin: cut to max_packed_len as truncation_mode says
                    self.c["pack_truncated_tokens"] += len(seq) - n
                    self.c["pack_truncated_docs"] += 1
                    seq = TokenSeq(seq.input_ids[start:start + n],
                                   None if seq.labels is None else seq.labels[start:start + n],
                                   seq.token_msg[start:start + n], seq.roles, seq.truncated + len(seq) - n)
                bin_.append(seq)
            self._emit((bin_, {}))
        self.pending = [] if final else self.pending[int(plan.piece_doc[plan.bin_offsets[closed]]):]

    def _emit(self, row):
        self.rows.append(row)
        if len(self.rows) >= self.o.row_group_rows:
            self._flush()

    def _flush(self):
        if not self.rows:
            return
        if self.multi:
            table = multi_output_table(self.rows, self.proc)
            tokens = sum(len(s) for out in self.rows for group in out.seqs.values() for s in group)
        else:
            table = bins_table(self.rows, self.job, self.proc)
            tokens = sum(len(s) for bin_, _ in self.rows for s in bin_)
            self.c["trained_written"] += trained_count(table)
        self.c["rows"] += len(self.rows)
        self.rows = []
        if self.writer is None:
            name = f"part-{self.part.index:05d}-{self.k:04d}.parquet"
            self.writer = ShardWriter(Path(self.job.out) / "data" / name, self.o.row_group_rows)
        self.writer.write(table)
        self.shard_tokens += tokens
        if self.shard_tokens >= self.o.max_tokens_per_shard:
            self.writer.close()
            self.writer, self.shard_tokens, self.k = None, 0, self.k + 1

    def finish(self) -> dict:
        if self.pending:
            self._pack(final=True)
        self._flush()
        if self.writer is not None:
            self.writer.close()
        return dict(self.c)

    def abort(self):
        if self.writer is not None:
            self.writer.abort()


def bins_table(rows: list, job: Job, proc: Processor):
    """Single-output rows: each a bin of documents (one document unpacked) and its values."""
    seqs = [s for bin_, _ in rows for s in bin_]
    row_offsets = np.concatenate([[0], np.cumsum([len(b) for b, _ in rows])]).astype(np.int64)
    cols = rows_columns([s.input_ids for s in seqs], [s.labels for s in seqs] if proc.has_labels else None,
                        np.array([len(s) for s in seqs], dtype=np.int64), row_offsets,
                        job.pipeline.output.position_ids_mode,
                        packed=job.pipeline.preprocessing.packing_strategy != "none")
    for key in sorted({k for _, vals in rows for k in vals}):
        cols[key] = value_array([vals.get(key) for _, vals in rows], *proc.value_types[key])
    return table_of(cols)


def multi_output_table(outs: list[RecordOutput], proc: Processor):
    """Multi-output rows: per token source {source}_input_ids/_labels (nested for list sources), values."""
    cols = {}
    for name in proc.sources:
        if name not in outs[0].seqs:
            continue  # a value-only source
        trains = proc.source_trains(name) and proc.has_labels
        seqs = [s for out in outs for s in out.seqs[name]]
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        if name in proc.list_sources:
            counts = np.array([len(out.seqs[name]) for out in outs], dtype=np.int64)
            cols[source_column(name, INPUT_IDS)] = nested_list_array(concat([s.input_ids for s in seqs]), lens, counts)
            if trains:
                cols[source_column(name, LABELS)] = nested_list_array(concat([s.labels for s in seqs]), lens, counts)
        else:
            cols[source_column(name, INPUT_IDS)] = list_array(concat([s.input_ids for s in seqs]), lens)
            if trains:
                cols[source_column(name, LABELS)] = list_array(concat([s.labels for s in seqs]), lens)
    for key in sorted({k for out in outs for k in out.values}):
        cols[key] = value_array([out.values.get(key) for out in outs], *proc.value_types[key])
    return table_of(cols)


# The intermediate's token files: each column's int32 tokens, documents back to back in partition
# order; document d starts at sum(lengths[:d]). A flat layout lets the packing pass read any piece
# with one pread at a computed offset (the values are int32 in the shards too, so no cast is lost).
TOKEN_DTYPE = np.dtype("<i4")


def token_file(work: Path, part_name: str, column: str) -> Path:
    return work / f"{part_name}.{column}.bin"


class IntermediateSink:
    """Documents to `.work/PPPPP.input_ids.bin` (and `.labels.bin` when labelled) plus their lengths
    to `.work/PPPPP.lengths.npy`, for global packing. The lengths file is written last: once it
    exists the token files are complete."""

    def __init__(self, job: Job, part: Partition):
        self.work, self.part_name = job.work, part.name
        self.files: dict = {}  # column -> open temporary file, created on the first flush
        self.lengths: list[int] = []
        self.pending: list[TokenSeq] = []

    def add(self, out: RecordOutput):
        self.pending.append(out.seq())
        if len(self.pending) >= 1024:
            self._flush()

    def _flush(self):
        if not self.pending:
            return
        cols = {INPUT_IDS: [s.input_ids for s in self.pending]}
        if self.pending[0].labels is not None:
            cols[LABELS] = [s.labels for s in self.pending]
        for column, arrays in cols.items():
            if column not in self.files:
                self.files[column] = open(fresh_tmp(token_file(self.work, self.part_name, column)), "wb")
            self.files[column].write(concat(arrays).astype(TOKEN_DTYPE, copy=False).tobytes())
        self.lengths.extend(len(s) for s in self.pending)
        self.pending = []

    def finish(self) -> dict:
        self._flush()
        for column, f in self.files.items():
            f.close()
            os.replace(f.name, token_file(self.work, self.part_name, column))
        atomic_write_bytes(self.work / f"{self.part_name}.lengths.npy",
                           _npy(np.array(self.lengths, dtype=np.int64)))
        return {"docs": len(self.lengths)}

    def abort(self):
        for f in self.files.values():
            f.close()
            Path(f.name).unlink(missing_ok=True)


class Intermediate:
    """One partition's token files, read a piece at a time with pread.

    Never memory-mapped: in bfd order a shard's pieces are scattered over every partition, and a
    mapping makes each touched page (a whole large folio on recent kernels) resident in this
    process, so RSS would grow with the intermediate's size. pread copies just the piece.
    """

    def __init__(self, work: Path, part_name: str):
        lengths = np.load(work / f"{part_name}.lengths.npy")
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # token offset of each document
        self.fds = {}
        for column in (INPUT_IDS, LABELS):
            path = token_file(work, part_name, column)
            if path.exists():
                self.fds[column] = os.open(path, os.O_RDONLY)

    @property
    def has_labels(self) -> bool:
        return LABELS in self.fds

    def read(self, column: str, row: int, start: int, n: int) -> np.ndarray:
        size = n * TOKEN_DTYPE.itemsize
        data = os.pread(self.fds[column], size, int(self.starts[row] + start) * TOKEN_DTYPE.itemsize)
        if len(data) != size:
            raise EOFError(f"intermediate {column} file is short: {len(data)} of {size} bytes")
        return np.frombuffer(data, dtype=TOKEN_DTYPE)

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()
