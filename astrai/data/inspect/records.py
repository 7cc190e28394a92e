"""Records mode: input records of a pipeline or recipe, exactly as preprocess will treat them.

The wanted records (the first N, or chosen ones counted from 0 in input order as preprocess reads
them) go through the same `Processor` as `astrai preprocess`, with its max_items and on_error, so
the token ids, labels and the filter/reject reasons shown are exactly what preprocess writes.
Position ids are those of an unpacked document (0..n-1; null when position_ids_mode is none or
the pipeline is multi-output). A recipe brings its inputs and tokenizer; `pipeline.KEY=...`
overrides go to its pipeline, as with `astrai run`.

Only what is shown is read: JSONL inputs are scanned line by line up to the last wanted record and
only wanted lines are parsed; Parquet inputs skip whole row groups by their metadata; JSON files
and saved HF datasets are read in order up to the last wanted one (JSON is parsed whole anyway).
Nothing is planned over the whole input, so a few records of a huge file come back in about the
time it takes to load the tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from astrai.errors import InputError, RecordError
from astrai.data.inspect.tokens import TokenText
from astrai.data.inspect.views import Entry, Report, shortest_floats
from astrai.data.stats import Tally, record_stats
from astrai.schema import IGNORE_INDEX


def records_report(title: str, pipeline, base_dir: str, tokenizer: str, inputs: list[str], wanted: list[int],
                   explicit: bool = False) -> Report:
    """The wanted records of `inputs` under `pipeline` (paths resolved by the caller: astrai.cli.inspect)."""
    from astrai.data.process import Processor
    from astrai.data.read import expand_inputs
    from astrai.text.tokenizer import load_tokenizer

    proc = Processor(pipeline, load_tokenizer(tokenizer, base_dir, pipeline.added_tokens), base_dir)
    seen: dict = {}
    items = list(read_records(expand_inputs(inputs), wanted, seen, pipeline.preprocessing.max_record_bytes))
    found = {i for i, _, _, _ in items}
    notes = [f"record {k}: not in the input (it has {seen.get('records')} records)"
             for k in wanted if explicit and k not in found]
    entries, tally = _process(proc, pipeline, TokenText(proc.tok), items)
    return Report(f"{title} on {', '.join(inputs)}", title, entries, record_stats([tally.summary()]), list(inputs),
                  notes)


def read_records(files: list[Path], wanted: list[int], seen: Optional[dict] = None,
                 max_record_bytes: Optional[int] = None) -> Iterator[tuple]:
    """(index, record | RecordError, file, where) for the wanted indices, reading only up to the last.

    Indices count records in input order as preprocess reads them (blank JSONL lines are not
    records, unparsable ones are). Unwanted records are skipped without parsing where the format
    allows (JSONL lines, Parquet row groups). When the input ends first, seen["records"] is its size.
    A line longer than `max_record_bytes` (default: the pipeline's default) is a record_too_large error.
    """
    from astrai.data.read import MAX_RECORD_BYTES, SUFFIX_KINDS

    max_bytes = max_record_bytes or MAX_RECORD_BYTES

    want, last, idx = set(wanted), max(wanted), 0
    for f in files:
        if idx > last:
            return
        kind = "arrow" if f.is_dir() else SUFFIX_KINDS.get(f.suffix.lower())
        if kind is None:
            raise InputError(f"input {f}: unknown format '{f.suffix}' (expected .jsonl, .json, .parquet or a "
                             f"save_to_disk directory)")
        reader = {"jsonl": _jsonl_records, "parquet": _parquet_records}.get(kind, _whole_records)
        idx = yield from reader(f, idx, want, last, max_bytes)
    if seen is not None and idx <= last:
        seen["records"] = idx


def _jsonl_records(f: Path, idx: int, want: set, last: int, max_bytes: int):
    from astrai.data.lines import LongLine, bounded_lines
    from astrai.data.read import Partition, read_partition

    offset, line = 0, 0
    with open(f, "rb") as fh:
        for raw in bounded_lines(fh, max_bytes):  # a longer line is passed over, never held
            line += 1
            start, offset = offset, offset + (raw.size if isinstance(raw, LongLine) else len(raw))
            if isinstance(raw, bytes) and not raw.strip():
                continue  # as the reader: a blank line is not a record
            if idx in want:  # parse this line alone, with the reader's own checks and messages
                for batch in read_partition(Partition(0, str(f), "jsonl", start, offset, line), 1, None, max_bytes):
                    for rec, where in batch:
                        yield idx, rec, str(f), where
            idx += 1
            if idx > last:
                break
    return idx


def _parquet_records(f: Path, idx: int, want: set, last: int, max_bytes: int):
    import pyarrow.parquet as pq

    from astrai.data.read import Partition, read_partition

    md = pq.ParquetFile(f).metadata
    row0 = 0
    for g in range(md.num_row_groups):
        rows = md.row_group(g).num_rows
        if any(idx <= k < idx + rows for k in want):
            k = idx
            for batch in read_partition(Partition(0, str(f), "parquet", g, g + 1, row0), 64):
                for rec, where in batch:
                    if k in want:
                        yield k, rec, str(f), where
                    k += 1
                if k > last:
                    break
        idx, row0 = idx + rows, row0 + rows
        if idx > last:
            break
    return idx


def _whole_records(f: Path, idx: int, want: set, last: int, max_bytes: int):
    """JSON files and saved HF datasets: read in order (a JSON document is parsed whole anyway)."""
    from astrai.data.read import plan_partitions, read_partition

    for part in plan_partitions([f], 1 << 62):
        for batch in read_partition(part, 64, None, max_bytes):
            for rec, where in batch:
                if idx in want:
                    yield idx, rec, part.file, where
                idx += 1
                if idx > last:
                    return idx
    return idx


def _where(file: str, where: str) -> str:
    rel = os.path.relpath(file) if os.path.isabs(file) else file
    shown = file if rel.startswith("..") else rel
    return f"{shown}:{where}" if where.isdigit() else f"{shown} {where}"


def _process(proc, pipeline, tt: TokenText, items) -> tuple[list[Entry], Tally]:
    """Entries for the records shown, and their statistics counted as preprocess counts them."""
    from astrai.data.process import Filtered

    pp = pipeline.preprocessing
    todo = [(i, rec) for i, rec, _, _ in items
            if not isinstance(rec, RecordError) and (pp.max_items is None or i < pp.max_items)]
    results = dict(zip([i for i, _ in todo], proc.process_batch([rec for _, rec in todo]))) if todo else {}
    entries, tally = [], Tally()
    for i, rec, file, where in items:
        e = Entry("record", i, _where(file, where), "kept")
        res = rec if isinstance(rec, RecordError) else results.get(i)
        if res is None:
            e.status, e.reason = "excluded", "max_items"
            e.detail = f"preprocessing.max_items is {pp.max_items}: preprocess reads records 0..{pp.max_items - 1}"
        elif isinstance(res, RecordError):
            err = res.located(file, where)
            tally.add_rejected(err.reason)
            e.status, e.reason, e.detail = "rejected", err.reason, str(err)
            if pp.on_error == "raise":
                e.notes.append("on_error is raise: preprocess stops at this record")
        elif isinstance(res, Filtered):
            e.status, e.reason, e.detail = "filtered", res.reason, res.detail
            tally.add_filtered(res.reason)
        else:
            _fill_doc(e, res, proc, pipeline, tt)
            tally.add_kept(res)
        if e.status != "excluded":
            tally.c["read"] += 1
        entries.append(e)
    return entries, tally


def _fill_doc(e: Entry, doc, proc, pipeline, tt: TokenText):
    multi = pipeline.input.sources is not None
    mode = "none" if multi else pipeline.output.position_ids_mode  # multi-output rows carry no position ids
    for name, group in doc.seqs.items():  # a value-only source (rewards) has no sequences
        for j, s in enumerate(group):
            item = j if name in proc.list_sources else None  # numbered only for list sources (GRPO)
            n = len(s)
            trained = np.ones(n, bool) if s.labels is None else np.asarray(s.labels) != IGNORE_INDEX
            pos = None if mode == "none" else np.arange(n, dtype=np.int64)
            e.seqs.append(tt.view(s.input_ids, trained, pos, np.zeros(n, np.int64), msg=np.asarray(s.token_msg),
                                  roles=list(s.roles), truncated=int(s.truncated), source=name, item=item))
    e.values = shortest_floats(doc.values)  # as the float32 column will hold them
    pp, packed = pipeline.preprocessing, pipeline.bin_capacity
    n = len(e.seqs[0].ids) if e.seqs else 0
    if not multi and packed and pp.packing_strategy != "none" and n > packed:
        e.notes.append(f"bfd_split: split over {-(-n // packed)} bins of {packed} tokens"
                       if pp.packing_strategy == "bfd_split" else
                       f"packing cuts {n - packed} more tokens ({pp.truncation_mode}, max_packed_len {packed})")
