"""The tokenize pass: one input partition read, rendered, tokenized, masked, counted and written.

Records go batch by batch through the Processor (process_stream: a batch is encoded while the
one before it is labelled and the next one rendered); each result is counted (kept / filtered /
rejected by reason, into a `Tally`) and kept records go to a sink: straight to the partition's
shards (unpacked, simple packing, multi-output), or to an intermediate file for global packing.
The partition's statistics are written last, as its completion marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    job, proc, part, limit = worker.job, worker.processor, task.part, task.limit
    pp = job.pipeline.preprocessing
    tally = Tally()
    rejects = []
    sink = IntermediateSink(job, part) if job.global_pack else ShardSink(job, part, proc)
    try:
        with fewer_collections():  # its containers die young, in no cycle
            for batch, results in proc.process_stream(_batches(part, pp.batch_size, job, limit)):
                tally.c["read"] += len(batch)
                results = iter(results)
                for rec, where in batch:
                    res = rec if isinstance(rec, RecordError) else next(results)
                    if isinstance(res, RecordError):
                        err = res.located(part.file, where)
                        if pp.on_error == "raise":
                            raise err
                        tally.add_rejected(err.reason)
                        rejects.append({**err.as_json(), **({"record": rec} if isinstance(rec, dict) else {})})
                    elif isinstance(res, Filtered):
                        tally.add_filtered(res.reason)
                    else:
                        tally.add_kept(res)
                        sink.add(res)
        extra = sink.finish()
    except BaseException:
        sink.abort()
        raise
    if rejects:
        atomic_write_text(job.work / f"{part.name}.rejects.jsonl",
                          "".join(json_line(r) for r in rejects))
    mark_done(job.marker(part.name), tally.summary(**extra))


def _batches(part: Partition, batch_size: int, job, limit: Optional[int]):
    """(batch of (record, where), its good records) for process_stream, at most `limit` records."""
    keep = job.holdout.keep(part.file) if job.holdout is not None else None
    read = 0
    for batch in read_partition(part, batch_size, keep):
        if limit is not None:
            batch = batch[: max(limit - read, 0)]
            if not batch:
                return
        read += len(batch)
        yield batch, [rec for rec, _ in batch if not isinstance(rec, RecordError)]
