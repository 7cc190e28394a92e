"""The tokenize pass: one input partition read, rendered, tokenized, masked, counted and written.

Records go batch by batch through the Processor (process_stream: a batch is encoded while the
one before it is labelled and the next one rendered; in one process, across partitions too); each
result is counted (kept / filtered / rejected by reason, into a `Tally`) and kept records go to a
sink: straight to the partition's shards (unpacked, simple packing, multi-output), or to an
intermediate file for global packing.
The partition's statistics are written last, as its completion marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from astrai.errors import RecordError
from astrai.data.preprocess.job import Worker
from astrai.data.preprocess.shards import IntermediateSink, ShardSink
from astrai.data.process import Filtered
from astrai.data.read import Partition, read_partition
from astrai.data.stats import Tally
from astrai.data.write import json_line
from astrai.runtime import atomic_write_text, fewer_collections, mark_done


@dataclass(frozen=True)
class PartitionTask:
    part: Partition
    limit: Optional[int] = None  # read at most this many records (what is left of max_items)

    @property
    def name(self) -> str:
        return self.part.name  # pPPPPP


def tokenize_partition(worker: Worker, task: PartitionTask):
    tokenize_partitions(worker, [task])


def tokenize_partitions(worker: Worker, tasks: list[PartitionTask], on_done: Callable = lambda task: None):
    """Partitions one after another in this process, through one stream: the next partition's first
    batch is rendered and encoded while the one before it is labelled and finished, and batches of
    small partitions are encoded together up to `batch_size` records (automatic partitions are
    mostly smaller than a batch: one encode call each would leave the tokenizer's threads waiting
    on each call's longest text). Each partition is finished (shards or intermediate, rejects, then
    its marker) before on_done(task)."""
    job, proc = worker.job, worker.processor
    pp = job.pipeline.preprocessing

    def stream():  # (segments, their good records); a segment: (task index, batch or None to close it, good count)
        segments, good_records, n = [], [], 0
        for i, task in enumerate(tasks):
            for batch, good in _batches(task.part, pp.batch_size, job, task.limit):
                segments.append((i, batch, len(good)))
                good_records += good
                n += len(batch)
                if n >= pp.batch_size:
                    yield segments, good_records
                    segments, good_records, n = [], [], 0
            segments.append((i, None, 0))
        if segments:
            yield segments, good_records

    current: Optional[_Partition] = None
    try:
        with fewer_collections():  # its containers die young, in no cycle
            for segments, results in proc.process_stream(stream()):
                at = 0
                for i, batch, k in segments:
                    current = current or _Partition(job, proc, tasks[i].part)
                    if batch is not None:
                        current.take(batch, results[at:at + k])
                        at += k
                        continue
                    extra = current.sink.finish()
                    done, current = current, None
                    done.close(extra)
                    on_done(tasks[i])
    except BaseException:
        if current is not None:
            current.sink.abort()
        raise


class _Partition:
    """One partition's counts, rejects and sink while its batches go by."""

    def __init__(self, job, proc, part: Partition):
        self.job, self.part, self.tally, self.rejects = job, part, Tally(), []
        self.sink = IntermediateSink(job, part) if job.global_pack else ShardSink(job, part, proc)

    def take(self, batch, results):
        self.tally.c["read"] += len(batch)
        results = iter(results)
        for rec, where in batch:
            res = rec if isinstance(rec, RecordError) else next(results)
            if isinstance(res, RecordError):
                err = res.located(self.part.file, where)
                if self.job.pipeline.preprocessing.on_error == "raise":
                    raise err
                self.tally.add_rejected(err.reason)
                self.rejects.append({**err.as_json(), **({"record": rec} if isinstance(rec, dict) else {})})
            elif isinstance(res, Filtered):
                self.tally.add_filtered(res.reason)
            else:
                self.tally.add_kept(res)
                self.sink.add(res)

    def close(self, extra: dict):
        """After the sink finished: the rejects, then the marker (the partition is done)."""
        if self.rejects:
            atomic_write_text(self.job.work / f"{self.part.name}.rejects.jsonl",
                              "".join(json_line(r) for r in self.rejects))
        mark_done(self.job.marker(self.part.name), self.tally.summary(**extra))


def _batches(part: Partition, batch_size: int, job, limit: Optional[int]):
    """(batch of (record, where), its good records) for process_stream, at most `limit` records."""
    keep = job.holdout.keep(part.file) if job.holdout is not None else None
    read = 0
    for batch in read_partition(part, batch_size, keep, job.pipeline.preprocessing.max_record_bytes):
        if limit is not None:
            batch = batch[: max(limit - read, 0)]
            if not batch:
                return
        read += len(batch)
        yield batch, [rec for rec, _ in batch if not isinstance(rec, RecordError)]
