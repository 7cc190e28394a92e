"""The preprocess stage: inputs -> Parquet shards + manifest.json + stats.json (+ rejects.jsonl).

Work is split into input partitions (astrai.data.read), which depend only on the inputs, so any
number of workers gives byte-identical output, and the same steps can run as tasks of a
distributed engine (one task per partition, then one per shard):

- packing none/simple, and multi-output pipelines: one pass. A partition is read, tokenized and
  masked batch by batch and written straight to its own shards `data/part-PPPPP-KKKK.parquet`
  (simple packing is next-fit within the partition). Memory is one batch plus one row group.
- packing bfd/bfd_split (global): pass 1 writes each partition's documents to an intermediate
  Arrow file plus its document lengths; pass 2 plans bins from the lengths of the whole dataset
  (the only thing held for all documents), then gathers each shard's pieces from the
  memory-mapped intermediates into `data/packed-KKKKK.parquet`.

Crash safety: every file is written under a temporary name and renamed when complete; a partition
is done when its summary (`.work/PPPPP.json`) exists, a shard when its final name exists, the
whole run when manifest.json exists. A rerun after SIGKILL skips what is done and redoes the
rest, which is deterministic, so the result is byte-identical to an uninterrupted run. A rerun
with the same fingerprint (inputs, pipeline, tokenizer files, template, format version) does
nothing; any change invalidates the old output.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from astrai import __version__
from astrai.config import Pipeline
from astrai.data.errors import InputError, RecordError
from astrai.data.process import Doc, Filtered, Processor, Seq
from astrai.data.read import Partition, expand_inputs, file_fingerprint, plan_partitions, read_partition
from astrai.data.template import resolve_template
from astrai.data.tokenizer import load_tokenizer
from astrai.data.write import (
    ShardWriter, atomic_write_bytes, atomic_write_text, concat, json_line, list_array, nested_list_array,
    remove_stale_tmp,
    rows_columns, value_array,
)

FORMAT_VERSION = 1
WORK = ".work"
HIST_EDGES = [2 ** k for k in range(4, 18)]  # document length histogram buckets (<=16 ... <=131072, more)


@dataclass(frozen=True)
class Job:
    """Everything a worker needs; picklable, so workers can be processes or remote tasks."""

    pipeline: Pipeline
    tokenizer: str
    base_dir: str
    out: str

    @property
    def global_pack(self) -> bool:
        return self.pipeline.preprocessing.packing_strategy in ("bfd", "bfd_split")


# ---------------------------------------------------------------------------------------------
# entry point


def run_preprocess(pipeline: Pipeline, inputs: list[str], out: str, tokenizer: Optional[str] = None,
                   workers: Optional[int] = None, base_dir: Optional[str] = None,
                   log: Callable[[str], None] = print) -> dict:
    base_dir = str(base_dir or os.getcwd())
    tok_spec = tokenizer or pipeline.tokenizer
    if not tok_spec:
        raise InputError("no tokenizer: set `tokenizer:` in the pipeline, the recipe, or pass --tokenizer DIR")
    tok = load_tokenizer(tok_spec, base_dir)
    template = resolve_template(pipeline.chat_template, tok, base_dir) if pipeline.chat_template else None
    warnings: list[str] = []  # skipped or empty inputs, ignored settings: said, not ignored
    pp = pipeline.preprocessing
    if pp.max_packed_len is not None and pp.packing_strategy == "none":
        # a warning, not an error: `--set preprocessing.packing_strategy=none` on a packing pipeline is common
        warnings.append(f"preprocessing.max_packed_len ({pp.max_packed_len}) is ignored with packing_strategy: none "
                        f"(one document per row); set a packing_strategy to pack")
    files = expand_inputs(inputs, warnings=warnings)  # relative to the working directory (recipes join their base)
    for w in warnings:
        log(f"warning: {w}")
    digests: dict = {}  # JSONL hashes taken while planning partitions: one read of each input
    parts = plan_partitions(files, pipeline.preprocessing.partition_bytes, digests)
    fp = fingerprint(pipeline, tok.fingerprint, template.source if template else "", files, digests)
    outp = Path(out)
    manifest = outp / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()).get("fingerprint") == fp:
        shutil.rmtree(outp / WORK, ignore_errors=True)  # left if a run died right after its manifest
        log(f"{out}: up to date (fingerprint {fp[:12]}), nothing to do")
        return json.loads((outp / "stats.json").read_text())
    _prepare_out(outp, fp)
    job = Job(pipeline, str(tok.path), base_dir, str(outp))
    workers = max(1, workers or os.cpu_count() or 1)

    _processor(job, tok, template)  # built once here (no encoding yet), inherited by forked workers
    todo = [p for p in parts if not (outp / WORK / f"{p.name}.json").exists()]
    if len(todo) < len(parts):
        log(f"resuming: {len(parts) - len(todo)} of {len(parts)} partitions already done")
    if pipeline.preprocessing.max_items is not None:
        # A record limit in input order needs the counts of earlier partitions: run them in order.
        _run_limited(job, parts, log)
    else:
        _map(workers, _pass1, [(job, p) for p in todo], log, "partitions")

    summaries = [json.loads((outp / WORK / f"{p.name}.json").read_text()) for p in parts]
    packing = _pass2(job, parts, workers, log) if job.global_pack else None
    stats = _stats(pipeline, summaries, packing)
    shards = sorted(str(p.relative_to(outp)) for p in (outp / "data").glob("*.parquet"))
    _write_rejects(outp, parts)
    atomic_write_text(outp / "stats.json", json.dumps(stats, indent=2) + "\n")  # keys in reading order
    man = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "pipeline": json.loads(pipeline.model_dump_json()),
        "tokenizer": {"path": str(tok.path), "fingerprint": tok.fingerprint},
        "chat_template": template.name if template else None,
        "inputs": [str(f) for f in files],
        "shards": shards,
        "columns": _columns(outp, shards),
        "counts": {k: stats[k] for k in ("records_read", "records_kept", "records_filtered", "records_rejected",
                                         "rows", "tokens")},
    }
    atomic_write_text(manifest, json.dumps(man, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(outp / WORK, ignore_errors=True)
    log(f"{out}: {stats['records_kept']} records kept of {stats['records_read']} read, {stats['rows']} rows, "
        f"{stats['tokens']} tokens ({stats['trained_tokens']} trained) in {len(shards)} shard(s)")
    return stats


def fingerprint(pipeline: Pipeline, tok_fp: str, template_src: str, files: list[Path],
                digests: Optional[dict] = None) -> str:
    h = hashlib.sha256()
    # partition_bytes changes partitions, hence shard names: it is part of the pipeline dump
    # the astrai version is in: a release that changes how records are tokenized must not reuse old output
    h.update(json.dumps({"format": FORMAT_VERSION, "astrai": __version__,
                         "pipeline": json.loads(pipeline.model_dump_json()),
                         "tokenizer": tok_fp, "template": template_src}, sort_keys=True).encode())
    for f in files:
        h.update(f.name.encode() + b"\0")
        if f.is_dir():
            for sub in sorted(f.rglob("*")):
                if sub.is_file():
                    h.update(sub.name.encode() + file_fingerprint(str(sub)).encode())
        else:
            h.update(((digests or {}).get(str(f)) or file_fingerprint(str(f))).encode())
    return h.hexdigest()


def _prepare_out(outp: Path, fp: str):
    work = outp / WORK
    if outp.exists() and any(outp.iterdir()):
        ours = any((outp / n).exists() for n in ("manifest.json", "stats.json", WORK))
        if not ours:
            raise InputError(f"output {outp} exists, is not empty and is not an astrai output; choose another -o")
        stale = not (work / "fingerprint").exists() or (work / "fingerprint").read_text() != fp
        if stale:  # another pipeline/input/tokenizer: the old output is invalid
            # Markers go first, shards after: killed half-way, the leftovers must never read as done
            # (a manifest saying "up to date", or .work/fingerprint resuming into partitions whose
            # shards are gone), and .work itself stays until the shards are gone so the directory
            # is still recognised as ours.
            for name in ("manifest.json", f"{WORK}/fingerprint", "data", WORK, "stats.json", "rejects.jsonl"):
                target = outp / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
    (outp / "manifest.json").unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (outp / "data").mkdir(exist_ok=True)
    remove_stale_tmp(outp)  # stats.json, manifest.json and rejects.jsonl are written under temporary names too
    remove_stale_tmp(outp / "data")
    remove_stale_tmp(work)
    if not (work / "fingerprint").exists():
        atomic_write_text(work / "fingerprint", fp)


def _map(workers: int, fn, args: list, log, what: str):
    if not args:
        return
    if workers == 1 or len(args) == 1:
        for a in args:
            fn(a)
        return
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    # fork where available: workers start at once and a caller's script needs no __main__ guard. The
    # parent never encodes, so no tokenizer thread pool is inherited half-initialized.
    # Not multiprocessing.Pool: when a worker is killed from outside (the OOM killer), Pool waits
    # forever for its task; this executor fails the run, and a rerun resumes.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(min(workers, len(args)), mp_context=ctx, initializer=_worker_init)
    try:
        futures = [pool.submit(fn, a) for a in args]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()
    except BrokenProcessPool:
        raise RuntimeError(f"a worker process died while processing {what} (killed from outside, e.g. out of "
                           f"memory); finished {what} are kept: rerun to resume") from None
    except BaseException:
        # stop at the first error, as Pool.terminate did: the other workers' unfinished work is redone
        # on a rerun (tmp files are removed then)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    log(f"{len(args)} {what} done with {workers} workers")


def _worker_init():
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per worker process


def _run_limited(job: Job, parts: list[Partition], log):
    budget = job.pipeline.preprocessing.max_items
    for p in parts:
        done = Path(job.out) / WORK / f"{p.name}.json"
        if not done.exists():
            _pass1((job, p), limit=budget)
        # a partition that read nothing (budget already spent, or only blank lines) has no "read" count
        budget -= json.loads(done.read_text()).get("read", 0)
        budget = max(budget, 0)


# ---------------------------------------------------------------------------------------------
# pass 1: one partition


_PROCESSORS: dict = {}


def _processor(job: Job, tok=None, template=None) -> Processor:
    """The job's Processor, built once per process (from an already loaded tokenizer/template if given)."""
    key = (job.pipeline.model_dump_json(), job.tokenizer, job.base_dir)
    if key not in _PROCESSORS:
        _PROCESSORS[key] = Processor(job.pipeline, tok or load_tokenizer(job.tokenizer), job.base_dir, template)
    return _PROCESSORS[key]


class _Tally:
    def __init__(self):
        self.c = Counter()
        self.filtered, self.rejected = Counter(), Counter()
        self.roles, self.trained_roles, self.domains, self.hist = Counter(), Counter(), Counter(), Counter()

    def add_seq(self, seq: Seq):
        self.c["tokens"] += len(seq)
        self.c["trained_tokens"] += seq.trained
        self.c["truncated_tokens"] += seq.truncated
        self.c["truncated_docs"] += bool(seq.truncated)
        idx = np.searchsorted(HIST_EDGES, len(seq))
        self.hist[f"<={HIST_EDGES[idx]}" if idx < len(HIST_EDGES) else f">{HIST_EDGES[-1]}"] += 1
        counts = np.bincount(seq.token_msg + 1, minlength=len(seq.roles) + 1)
        trained = (np.bincount(seq.token_msg + 1, weights=(seq.labels != -100), minlength=len(seq.roles) + 1)
                   if seq.labels is not None else counts)
        # index 0 holds tokens outside any message: chat template text (headers, end-of-turn), or plain text
        for i, role in enumerate(["template" if seq.roles else "text"] + seq.roles):
            if counts[i]:
                self.roles[role] += int(counts[i])
            if trained[i]:
                self.trained_roles[role] += int(trained[i])

    def summary(self, **extra) -> dict:
        return {**self.c, "filtered": dict(self.filtered), "rejected": dict(self.rejected), "roles": dict(self.roles),
                "trained_roles": dict(self.trained_roles), "domains": dict(self.domains), "hist": dict(self.hist),
                **extra}


def _pass1(arg, limit: Optional[int] = None):
    job, part = arg
    proc = _processor(job)
    pp = job.pipeline.preprocessing
    outp = Path(job.out)
    tally = _Tally()
    rejects = []
    sink = _IntermediateSink(job, part) if job.global_pack else _ShardSink(job, part, proc)
    try:
        for batch in read_partition(part, pp.batch_size):
            if limit is not None:
                batch = batch[: max(limit - tally.c["read"], 0)]
                if not batch:
                    break
            tally.c["read"] += len(batch)
            good = [(rec, where) for rec, where in batch if not isinstance(rec, RecordError)]
            results = proc.process_batch([rec for rec, _ in good]) if good else []
            res_iter = iter(results)
            for rec, where in batch:
                res = rec if isinstance(rec, RecordError) else next(res_iter)
                if isinstance(res, RecordError):
                    err = res.located(part.file, where)
                    if pp.on_error == "raise":
                        raise err
                    tally.rejected[err.reason] += 1
                    rejects.append({**err.as_json(), **({"record": rec} if isinstance(rec, dict) else {})})
                elif isinstance(res, Filtered):
                    tally.filtered[res.reason] += 1
                else:
                    tally.c["kept"] += 1
                    if res.domain is not None:
                        tally.domains[res.domain] += 1
                    for seq in res.seqs.values():
                        for s in seq if isinstance(seq, list) else [seq]:
                            tally.add_seq(s)
                    sink.add(res)
        extra = sink.finish()
    except BaseException:
        sink.abort()
        raise
    work = outp / WORK
    if rejects:
        atomic_write_text(work / f"{part.name}.rejects.jsonl",
                          "".join(json_line(r) for r in rejects))
    # the summary is the partition's completion marker: written last
    atomic_write_text(work / f"{part.name}.json", json.dumps(tally.summary(**extra), sort_keys=True))


class _ShardSink:
    """Rows straight to this partition's shards (unpacked, simple next-fit, multi-output)."""

    def __init__(self, job: Job, part: Partition, proc: Processor):
        self.job, self.part, self.proc = job, part, proc
        self.o = job.pipeline.output
        self.pp = job.pipeline.preprocessing
        self.multi = job.pipeline.input.sources is not None
        self.max_len = job.pipeline.packed_len
        self.rows: list = []  # pending rows: multi-output Docs, or bins (lists of Seq)
        self.bin: list[Seq] = []
        self.bin_len = 0
        self.k = 0
        self.writer: Optional[ShardWriter] = None
        self.shard_tokens = 0
        self.c = Counter()

    def add(self, doc: Doc):
        if self.multi:
            self.rows.append(doc)
        else:
            seq = doc.seqs[""]
            if self.pp.packing_strategy == "simple":
                seq = self._fit(seq)
                if self.bin and self.bin_len + len(seq) > self.max_len:
                    self._close_bin()
                self.bin.append(seq)
                self.bin_len += len(seq)
            else:
                self.rows.append(([seq], doc.values))
        if len(self.rows) >= self.o.row_group_rows:
            self._flush()

    def _fit(self, seq: Seq) -> Seq:
        if len(seq) <= self.max_len:
            return seq
        cut = len(seq) - self.max_len
        self.c["pack_truncated_tokens"] += cut
        self.c["pack_truncated_docs"] += 1
        keep = slice(0, self.max_len) if self.pp.truncation_mode == "keep_start" else slice(cut, None)
        return Seq(seq.input_ids[keep], None if seq.labels is None else seq.labels[keep], seq.token_msg[keep],
                   seq.roles, seq.truncated + cut)

    def _close_bin(self):
        self.rows.append((self.bin, {}))
        self.bin, self.bin_len = [], 0

    def _flush(self):
        if not self.rows:
            return
        table = _multi_table(self.rows, self.proc) if self.multi else _bins_table(self.rows, self.job, self.proc)
        tokens = sum(_row_tokens(r, self.multi) for r in self.rows)
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
        if self.bin:
            self._close_bin()
        self._flush()
        if self.writer is not None:
            self.writer.close()
        return dict(self.c)

    def abort(self):
        if self.writer is not None:
            self.writer.abort()


def _row_tokens(row, multi: bool) -> int:
    if multi:
        return sum(len(s) for seq in row.seqs.values() for s in (seq if isinstance(seq, list) else [seq]))
    return sum(len(s) for s in row[0])


def _bins_table(rows, job: Job, proc: Processor):
    import pyarrow as pa

    seqs = [s for bin_, _ in rows for s in bin_]
    row_offsets = np.concatenate([[0], np.cumsum([len(b) for b, _ in rows])]).astype(np.int64)
    cols = rows_columns([s.input_ids for s in seqs], [s.labels for s in seqs] if proc.has_labels else None,
                        np.array([len(s) for s in seqs], dtype=np.int64), row_offsets,
                        job.pipeline.output.position_ids_mode,
                        packed=job.pipeline.preprocessing.packing_strategy != "none")
    for key in sorted({k for _, vals in rows for k in vals}):
        cols[key] = value_array([vals.get(key) for _, vals in rows], *proc.value_types[key])
    return pa.table(cols)


def _multi_table(docs: list[Doc], proc: Processor):
    import pyarrow as pa

    cols = {}
    for name in proc.sources:
        first = docs[0].seqs.get(name)
        if first is None:
            continue  # a value-only source
        trains = proc.source_trains(name) and proc.has_labels
        if isinstance(first, list):
            inner = [s for d in docs for s in d.seqs[name]]
            lens = np.array([len(s) for s in inner], dtype=np.int64)
            counts = np.array([len(d.seqs[name]) for d in docs], dtype=np.int64)
            cols[f"{name}_input_ids"] = nested_list_array(concat([s.input_ids for s in inner]), lens, counts)
            if trains:
                cols[f"{name}_labels"] = nested_list_array(concat([s.labels for s in inner]), lens, counts)
        else:
            seqs = [d.seqs[name] for d in docs]
            lens = np.array([len(s) for s in seqs], dtype=np.int64)
            cols[f"{name}_input_ids"] = list_array(concat([s.input_ids for s in seqs]), lens)
            if trains:
                cols[f"{name}_labels"] = list_array(concat([s.labels for s in seqs]), lens)
    for key in sorted({k for d in docs for k in d.values}):
        cols[key] = value_array([d.values.get(key) for d in docs], *proc.value_types[key])
    return pa.table(cols)


class _IntermediateSink:
    """bfd pass 1: documents to `.work/PPPPP.arrow` (input_ids, labels) plus their lengths."""

    def __init__(self, job: Job, part: Partition):
        import pyarrow as pa

        self.pa = pa
        self.path = Path(job.out) / WORK / f"{part.name}.arrow"
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.has_labels = None
        self.writer = None
        self.lengths: list[int] = []
        self.pending: list[Seq] = []

    def add(self, doc: Doc):
        self.pending.append(doc.seqs[""])
        if len(self.pending) >= 1024:
            self._flush()

    def _flush(self):
        if not self.pending:
            return
        pa = self.pa
        lens = np.array([len(s) for s in self.pending], dtype=np.int64)
        labels = [s.labels for s in self.pending] if self.pending[0].labels is not None else None
        table = pa.table(rows_columns([s.input_ids for s in self.pending], labels, lens,
                                      np.arange(len(lens) + 1), "none", with_seq_lens=False))
        if self.writer is None:
            self.writer = pa.ipc.new_file(str(self.tmp), table.schema)
        self.writer.write_table(table)
        self.lengths.extend(lens.tolist())
        self.pending = []

    def finish(self) -> dict:
        self._flush()
        if self.writer is not None:
            self.writer.close()
            os.replace(self.tmp, self.path)
        atomic_write_bytes(self.path.with_suffix(".lengths.npy"), _npy(np.array(self.lengths, dtype=np.int64)))
        return {"docs": len(self.lengths)}

    def abort(self):
        if self.writer is not None:
            self.writer.close()
        self.tmp.unlink(missing_ok=True)


def _npy(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# pass 2: global bins -> shards


def _pass2(job: Job, parts: list[Partition], workers: int, log) -> dict:
    from astrai.data.packing import plan_bins

    work = Path(job.out) / WORK
    lengths = [np.load(work / f"{p.name}.lengths.npy") for p in parts]
    doc_part = np.concatenate([np.full(len(l), i, dtype=np.int32) for i, l in enumerate(lengths)]) if lengths else \
        np.zeros(0, np.int32)
    doc_local = np.concatenate([np.arange(len(l), dtype=np.int64) for l in lengths]) if lengths else \
        np.zeros(0, np.int64)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    pp = job.pipeline.preprocessing
    plan = plan_bins(all_lengths, job.pipeline.packed_len, pp.packing_strategy, pp.truncation_mode)
    # shards: consecutive bins until max_tokens_per_shard
    bin_tokens = plan.bin_lengths()
    shard_of_bin = _shard_ranges(bin_tokens, job.pipeline.output.max_tokens_per_shard)
    tasks = []
    for k, (b0, b1) in enumerate(shard_of_bin):
        path = Path(job.out) / "data" / f"packed-{k:05d}.parquet"
        if path.exists():
            continue
        p0, p1 = plan.bin_offsets[b0], plan.bin_offsets[b1]
        pieces = (doc_part[plan.piece_doc[p0:p1]], doc_local[plan.piece_doc[p0:p1]], plan.piece_start[p0:p1],
                  plan.piece_len[p0:p1], plan.bin_offsets[b0:b1 + 1] - p0)
        tasks.append((job, [p.name for p in parts], str(path), pieces))
    _map(workers, _write_packed_shard, tasks, log, "shards")
    total = int(bin_tokens.sum())
    n_bins = plan.n_bins
    return {"bins": n_bins, "pack_truncated_tokens": int(plan.truncated_tokens),
            "pack_truncated_docs": int(plan.truncated_docs),
            "packing_efficiency": (total / (n_bins * job.pipeline.packed_len)) if n_bins else None,
            "rows": n_bins}


def _shard_ranges(bin_tokens: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    out, start, acc = [], 0, 0
    for b, t in enumerate(bin_tokens.tolist()):
        acc += t
        if acc >= max_tokens:
            out.append((start, b + 1))
            start, acc = b + 1, 0
    if start < len(bin_tokens):
        out.append((start, len(bin_tokens)))
    return out


def _write_packed_shard(arg):
    import pyarrow as pa

    job, part_names, path, (pparts, plocal, pstart, plen, boffs) = arg
    work = Path(job.out) / WORK
    tables = {}

    def table(i):
        if i not in tables:
            tables[i] = pa.ipc.open_file(pa.memory_map(str(work / f"{part_names[i]}.arrow"))).read_all()
        return tables[i]

    o = job.pipeline.output
    has_labels = None
    ids_out, lab_out = [], []
    for j in range(len(pparts)):
        t = table(int(pparts[j]))
        if has_labels is None:
            has_labels = "labels" in t.column_names
        row = int(plocal[j])
        s, n = int(pstart[j]), int(plen[j])
        ids_out.append(_list_slice(t.column("input_ids"), row, s, n))
        if has_labels:
            lab_out.append(_list_slice(t.column("labels"), row, s, n))
    cols = rows_columns(ids_out, lab_out if has_labels else None, plen, boffs, o.position_ids_mode, packed=True)
    w = ShardWriter(Path(path), o.row_group_rows)
    try:
        w.write(pa.table(cols))
        w.close()
    except BaseException:
        w.abort()
        raise


def _list_slice(col, row: int, start: int, n: int) -> np.ndarray:
    chunk_row = row
    for chunk in col.chunks:
        if chunk_row < len(chunk):
            off = chunk.offsets[chunk_row].as_py()
            return chunk.values.slice(off + start, n).to_numpy(zero_copy_only=False)
        chunk_row -= len(chunk)
    raise IndexError(row)


# ---------------------------------------------------------------------------------------------
# stats, rejects, manifest columns


def _stats(pipeline: Pipeline, summaries: list[dict], packing: Optional[dict]) -> dict:
    total = Counter()
    merged = {k: Counter() for k in ("filtered", "rejected", "roles", "trained_roles", "domains", "hist")}
    for s in summaries:
        for k, v in s.items():
            if k in merged:
                merged[k].update(v)
            elif isinstance(v, (int, float)):
                total[k] += v
    tokens = total["tokens"]
    stats = {
        "records_read": total["read"],
        "records_kept": total["kept"],
        "records_filtered": sum(merged["filtered"].values()),
        "records_rejected": sum(merged["rejected"].values()),
        "filtered_by_reason": dict(sorted(merged["filtered"].items())),
        "rejected_by_reason": dict(sorted(merged["rejected"].items())),
        "tokens": tokens,
        "trained_tokens": total["trained_tokens"],
        "supervised_share": (total["trained_tokens"] / tokens) if tokens else None,
        "truncated_tokens": total["truncated_tokens"],
        "truncated_docs": total["truncated_docs"],
        "tokens_per_role": dict(sorted(merged["roles"].items())),
        "trained_tokens_per_role": dict(sorted(merged["trained_roles"].items())),
        "records_per_domain": dict(sorted(merged["domains"].items())),
        "doc_length_histogram": {k: merged["hist"][k] for k in
                                 [f"<={e}" for e in HIST_EDGES] + [f">{HIST_EDGES[-1]}"] if merged["hist"][k]},
        "packing_strategy": pipeline.preprocessing.packing_strategy,
        "max_packed_len": pipeline.packed_len,
        "rows": total["rows"],
        "pack_truncated_tokens": total["pack_truncated_tokens"],
        "pack_truncated_docs": total["pack_truncated_docs"],
    }
    # The accounting identity, asserted on every run.
    assert stats["records_read"] == stats["records_kept"] + stats["records_filtered"] + stats["records_rejected"]
    if packing:
        stats.update(packing)
        stats["tokens_written"] = tokens - stats["pack_truncated_tokens"]
    else:
        stats["tokens_written"] = tokens - stats["pack_truncated_tokens"]
        stats["bins"] = stats["rows"]
        ml = pipeline.packed_len
        stats["packing_efficiency"] = (stats["tokens_written"] / (stats["rows"] * ml)) if (ml and stats["rows"] and
                                                                                         pipeline.input.sources is None) else None
    return stats


def _write_rejects(outp: Path, parts: list[Partition]):
    files = [outp / WORK / f"{p.name}.rejects.jsonl" for p in parts]
    files = [f for f in files if f.exists()]
    target = outp / "rejects.jsonl"
    if not files:
        target.unlink(missing_ok=True)
        return
    atomic_write_text(target, "".join(f.read_text(encoding="utf-8") for f in files))


def _columns(outp: Path, shards: list[str]) -> list[str]:
    """The columns as written (read from the first shard's schema, not declared a second time)."""
    import pyarrow.parquet as pq

    return pq.read_schema(outp / shards[0]).names if shards else []
