"""The preprocess stage: inputs -> Parquet shards + manifest.json + stats.json (+ rejects.jsonl).

Work is split into input partitions (astrai.data.read), which depend only on the inputs, so any
number of workers gives byte-identical output, and the same steps can run as tasks of a
distributed engine (one task per partition, then one per shard). Modules, by job:

- run.py       orchestration: fingerprint, output-directory lifecycle, the passes, stats, manifest
- tokenize.py  the tokenize pass: one partition read, tokenized, masked, counted, sent to a sink
- shards.py    the sinks: a partition's own shards `data/part-PPPPP-KKKK.parquet` (unpacked,
               simple next-fit packing, multi-output), or an intermediate for global packing
- pack.py      the global packing pass (bfd/bfd_split): bins planned from the lengths of the
               whole dataset, then gathered from the memory-mapped intermediates into
               `data/packed-KKKKK.parquet`
- job.py       the picklable job and the per-process worker context
Statistics live in astrai.data.stats (shared with inspect); the process pool, atomic writes and
completion markers in astrai.runtime (shared with the other stages).

Crash safety: every file is written under a temporary name and renamed when complete; a partition
is done when its summary (`.work/PPPPP.json`) exists, a shard when its final name exists, the
whole run when manifest.json exists. A rerun after SIGKILL skips what is done and redoes the
rest, which is deterministic, so the result is byte-identical to an uninterrupted run. A rerun
with the same fingerprint (inputs, pipeline, tokenizer files, template, format version) does
nothing; any change invalidates the old output.
"""

from astrai.data.preprocess.run import FORMAT_VERSION, fingerprint, run_preprocess

__all__ = ["FORMAT_VERSION", "fingerprint", "run_preprocess"]
