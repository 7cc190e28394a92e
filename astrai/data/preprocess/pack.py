"""The global packing pass (bfd, bfd_split): bins planned over the whole dataset, then shards.

Bins are planned from the document lengths of every partition (the only thing held for all
documents); consecutive bins make a shard until max_tokens_per_shard; each shard is one task
that gathers its pieces from the intermediates into `data/packed-KKKKK.parquet`, a row group at a
time, one pread per piece (never a mapping of a whole file), so memory stays bounded by a row
group whatever the input size.
A shard is done when its final name exists, so a rerun writes only the missing ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from astrai.data.packing import plan_bins
from astrai.data.preprocess.job import Job, Worker
from astrai.data.preprocess.shards import Intermediate
from astrai.data.read import Partition
from astrai.data.write import ShardWriter, rows_columns, table_of, trained_count
from astrai.runtime import atomic_write_text, read_marker, run_tasks
from astrai.schema import INPUT_IDS, LABELS


@dataclass(frozen=True)
class ShardTask:
    """One packed shard: its pieces, each a token range of a document in a partition's intermediate."""

    path: str
    part_names: list[str]  # intermediate file per partition index
    piece_part: np.ndarray  # partition index of each piece
    piece_row: np.ndarray  # the document's row inside that partition's intermediate
    piece_start: np.ndarray  # token offset of the piece in its document
    piece_len: np.ndarray
    bin_offsets: np.ndarray  # bin b holds pieces bin_offsets[b]:bin_offsets[b+1]

    @property
    def name(self) -> str:
        return Path(self.path).stem  # packed-KKKKK


def pack_globally(job: Job, parts: list[Partition], workers: int, worker: Worker,
                  log: Callable[[str], None], run: Callable = run_tasks, on_done: Optional[Callable] = None) -> dict:
    """Plan the bins (here), write the missing shards (tasks, through `run`: astrai.runtime.run_tasks
    or the Ray executor's, with `on_done` for the local one); return the packing figures for stats.json."""
    lengths = [np.load(job.work / f"{p.name}.lengths.npy") for p in parts]
    doc_part = np.concatenate([np.full(len(l), i, dtype=np.int32) for i, l in enumerate(lengths)]) if lengths else \
        np.zeros(0, np.int32)
    doc_row = np.concatenate([np.arange(len(l), dtype=np.int64) for l in lengths]) if lengths else \
        np.zeros(0, np.int64)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    pp = job.pipeline.preprocessing
    capacity = job.pipeline.bin_capacity
    plan = plan_bins(all_lengths, capacity, pp.packing_strategy, pp.truncation_mode)
    bin_tokens = plan.bin_lengths()
    tasks = []
    for k, (b0, b1) in enumerate(shard_ranges(bin_tokens, job.pipeline.output.max_tokens_per_shard)):
        path = Path(job.out) / "data" / f"packed-{k:05d}.parquet"
        if path.exists():
            continue
        p0, p1 = plan.bin_offsets[b0], plan.bin_offsets[b1]
        docs = plan.piece_doc[p0:p1]
        tasks.append(ShardTask(str(path), [p.name for p in parts], doc_part[docs], doc_row[docs],
                               plan.piece_start[p0:p1], plan.piece_len[p0:p1], plan.bin_offsets[b0:b1 + 1] - p0))
    run(write_packed_shard, tasks, workers=workers, setup=partial(Worker.build, job), context=worker,
        what="shards", log=log, **({"on_done": on_done} if on_done is not None else {}))
    n_bins = plan.n_bins
    n_shards = len(shard_ranges(bin_tokens, job.pipeline.output.max_tokens_per_shard))
    trained = sum(shard_trained(job, f"packed-{k:05d}") for k in range(n_shards))
    return {"bins": n_bins, "pack_truncated_tokens": int(plan.truncated_tokens),
            "pack_truncated_docs": int(plan.truncated_docs),
            "packing_efficiency": (int(bin_tokens.sum()) / (n_bins * capacity)) if n_bins else None,
            "rows": n_bins, "trained_written": trained}


def shard_marker(job: Job, name: str) -> Path:
    """A packed shard's trained-token count, written before the shard gets its final name (so a
    shard a rerun skips still has it). Not fsynced: it only saves counting the shard again, which
    shard_trained does when a power loss took it."""
    return job.work / f"{name}.json"


def shard_trained(job: Job, name: str) -> int:
    try:
        return int(read_marker(shard_marker(job, name))["trained"])
    except (OSError, ValueError, KeyError):
        import pyarrow.parquet as pq

        table = pq.read_table(Path(job.out) / "data" / f"{name}.parquet")
        return trained_count(table)


def shard_ranges(bin_tokens: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive bins [b0, b1) per shard: a shard closes once it holds max_tokens."""
    out, start, acc = [], 0, 0
    for b, t in enumerate(bin_tokens.tolist()):
        acc += t
        if acc >= max_tokens:
            out.append((start, b + 1))
            start, acc = b + 1, 0
    if start < len(bin_tokens):
        out.append((start, len(bin_tokens)))
    return out


def write_packed_shard(worker: Worker, task: ShardTask):
    """Gather and write the shard a row group at a time: memory is one row group's tokens (the
    pieces read with pread, then their columns), whatever the shard's or the input's size. Row
    groups are the ones a single write of the whole table would make (row_group_rows bins each)."""
    job = worker.job
    o = job.pipeline.output
    parts: dict[int, Intermediate] = {}

    def part(i: int) -> Intermediate:
        if i not in parts:
            parts[i] = Intermediate(job.work, task.part_names[i])
        return parts[i]

    has_labels = len(task.piece_part) > 0 and part(int(task.piece_part[0])).has_labels
    n_bins = len(task.bin_offsets) - 1
    trained = 0
    w = ShardWriter(Path(task.path), o.row_group_rows)
    try:
        for b0 in range(0, n_bins, o.row_group_rows):
            b1 = min(b0 + o.row_group_rows, n_bins)
            p0, p1 = int(task.bin_offsets[b0]), int(task.bin_offsets[b1])
            ids_out, lab_out = [], []
            for j in range(p0, p1):
                src = part(int(task.piece_part[j]))
                row, s, n = int(task.piece_row[j]), int(task.piece_start[j]), int(task.piece_len[j])
                ids_out.append(src.read(INPUT_IDS, row, s, n))
                if has_labels:
                    lab_out.append(src.read(LABELS, row, s, n))
            cols = rows_columns(ids_out, lab_out if has_labels else None, task.piece_len[p0:p1],
                                task.bin_offsets[b0:b1 + 1] - p0, o.position_ids_mode, packed=True)
            del ids_out, lab_out
            table = table_of(cols)
            trained += trained_count(table)
            w.write(table)
            del cols, table
        atomic_write_text(shard_marker(job, task.name), json.dumps({"trained": trained}), durable=False)
        w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        for src in parts.values():
            src.close()
