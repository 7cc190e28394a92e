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
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from astrai.data.errors import InputError, RecordError
from astrai.data.inspect.tokens import TokenText
from astrai.data.inspect.views import IGNORE, Entry, Report, shortest_floats


def records_report(path: str, inputs: Optional[list[str]], wanted: list[int], overrides: list[str],
                   tokenizer: Optional[str], explicit: bool = False) -> Report:
    from astrai.data.process import Processor
    from astrai.data.read import expand_inputs
    from astrai.data.tokenizer import load_tokenizer

    pipeline, pipe_dir, tok_spec, tok_base, recipe_inputs = _load_config(path, overrides, tokenizer)
    inputs = inputs or recipe_inputs
    if not inputs:
        raise InputError(f"{path} is a pipeline: give the records to inspect with -i INPUT (a recipe names its own)")
    proc = Processor(pipeline, load_tokenizer(tok_spec, tok_base), pipe_dir)
    seen: dict = {}
    items = list(read_records(expand_inputs(inputs), wanted, seen))
    found = {i for i, _, _, _ in items}
    notes = [f"record {k}: not in the input (it has {seen.get('records')} records)"
             for k in wanted if explicit and k not in found]
    entries = _process(proc, pipeline, TokenText(proc.tok), items)
    return Report(f"{path} on {', '.join(inputs)}", path, entries, records_stats(entries), list(inputs), notes)


def _load_config(path: str, overrides: list[str], tokenizer: Optional[str]):
    """(pipeline, pipeline dir, tokenizer spec, its base dir, the recipe's inputs) for a pipeline or a recipe."""
    from astrai.config import load_any

    if not Path(path).is_file():
        raise InputError(f"{path}: no such file (give a pipeline/recipe YAML or a preprocessed output directory)")
    cfg = load_any(path, tuple(overrides))  # a recipe's `pipeline.KEY=...` overrides go to its pipeline
    pipeline, pipe_path = cfg.pipeline, cfg.pipeline_path
    inputs = [cfg.recipe_path(i) for i in cfg.recipe.preprocess.inputs] if cfg.recipe else []
    spec, tok_base = cfg.recipe_tokenizer, None
    if tokenizer:
        # a path typed on the command line is relative to the working directory (else to the pipeline)
        spec, tok_base = tokenizer, Path.cwd() if Path(tokenizer).exists() else pipe_path.parent
    elif not spec:
        spec, tok_base = pipeline.tokenizer, pipe_path.parent
    if not spec:
        raise InputError("no tokenizer: set `tokenizer:` in the pipeline, the recipe, or pass --tokenizer DIR")
    return pipeline, str(pipe_path.parent), spec, tok_base, inputs


def read_records(files: list[Path], wanted: list[int], seen: Optional[dict] = None) -> Iterator[tuple]:
    """(index, record | RecordError, file, where) for the wanted indices, reading only up to the last.

    Indices count records in input order as preprocess reads them (blank JSONL lines are not
    records, unparsable ones are). Unwanted records are skipped without parsing where the format
    allows (JSONL lines, Parquet row groups). When the input ends first, seen["records"] is its size.
    """
    from astrai.data.read import SUFFIX_KINDS

    want, last, idx = set(wanted), max(wanted), 0
    for f in files:
        if idx > last:
            return
        kind = "arrow" if f.is_dir() else SUFFIX_KINDS.get(f.suffix.lower())
        if kind is None:
            raise InputError(f"input {f}: unknown format '{f.suffix}' (expected .jsonl, .json, .parquet or a "
                             f"save_to_disk directory)")
        reader = {"jsonl": _jsonl_records, "parquet": _parquet_records}.get(kind, _whole_records)
        idx = yield from reader(f, idx, want, last)
    if seen is not None and idx <= last:
        seen["records"] = idx


def _jsonl_records(f: Path, idx: int, want: set, last: int):
    from astrai.data.read import Partition, read_partition

    offset, line = 0, 0
    with open(f, "rb") as fh:
        for raw in fh:
            line += 1
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue  # as the reader: a blank line is not a record
            if idx in want:  # parse this line alone, with the reader's own checks and messages
                for batch in read_partition(Partition(0, str(f), "jsonl", start, offset, line), 1):
                    for rec, where in batch:
                        yield idx, rec, str(f), where
            idx += 1
            if idx > last:
                break
    return idx


def _parquet_records(f: Path, idx: int, want: set, last: int):
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


def _whole_records(f: Path, idx: int, want: set, last: int):
    """JSON files and saved HF datasets: read in order (a JSON document is parsed whole anyway)."""
    from astrai.data.read import plan_partitions, read_partition

    for part in plan_partitions([f], 1 << 62):
        for batch in read_partition(part, 64):
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


def _process(proc, pipeline, tt: TokenText, items) -> list[Entry]:
    from astrai.data.process import Filtered

    pp = pipeline.preprocessing
    todo = [(i, rec) for i, rec, _, _ in items
            if not isinstance(rec, RecordError) and (pp.max_items is None or i < pp.max_items)]
    results = dict(zip([i for i, _ in todo], proc.process_batch([rec for _, rec in todo]))) if todo else {}
    entries = []
    for i, rec, file, where in items:
        e = Entry("record", i, _where(file, where), "kept")
        res = rec if isinstance(rec, RecordError) else results.get(i)
        if res is None:
            e.status, e.reason = "excluded", "max_items"
            e.detail = f"preprocessing.max_items is {pp.max_items}: preprocess reads records 0..{pp.max_items - 1}"
        elif isinstance(res, RecordError):
            err = res.located(file, where)
            e.status, e.reason, e.detail = "rejected", err.reason, str(err)
            if pp.on_error == "raise":
                e.notes.append("on_error is raise: preprocess stops at this record")
        elif isinstance(res, Filtered):
            e.status, e.reason, e.detail = "filtered", res.reason, res.detail
        else:
            _fill_doc(e, res, proc, pipeline, tt)
        entries.append(e)
    return entries


def _fill_doc(e: Entry, doc, proc, pipeline, tt: TokenText):
    multi = pipeline.input.sources is not None
    mode = "none" if multi else pipeline.output.position_ids_mode  # multi-output rows carry no position ids
    for name, seq in doc.seqs.items():
        if all(sec.action == "value" for sec in proc.sources[name][0]):
            continue  # a value-only source (rewards) has no tokens: its values are shown with the record
        for j, s in enumerate(seq) if isinstance(seq, list) else [(None, seq)]:
            n = len(s)
            trained = np.ones(n, bool) if s.labels is None else np.asarray(s.labels) != IGNORE
            pos = None if mode == "none" else np.arange(n, dtype=np.int64)
            e.seqs.append(tt.view(s.input_ids, trained, pos, np.zeros(n, np.int64), msg=np.asarray(s.token_msg),
                                  roles=list(s.roles), truncated=int(s.truncated), source=name, item=j))
    e.values = shortest_floats(doc.values)  # as the float32 column will hold them
    pp, packed = pipeline.preprocessing, pipeline.packed_len
    n = len(e.seqs[0].ids) if e.seqs else 0
    if not multi and packed and pp.packing_strategy != "none" and n > packed:
        e.notes.append(f"bfd_split: split over {-(-n // packed)} bins of {packed} tokens"
                       if pp.packing_strategy == "bfd_split" else
                       f"packing cuts {n - packed} more tokens ({pp.truncation_mode}, max_packed_len {packed})")


def records_stats(entries: list[Entry]) -> dict:
    """The stats.json figures for the records shown (same keys, so one renderer serves both)."""
    from astrai.data.preprocess import HIST_EDGES

    c, filt, rej, roles, troles, hist = Counter(), Counter(), Counter(), Counter(), Counter(), Counter()
    for e in entries:
        c[e.status] += 1
        if e.status in ("filtered", "rejected"):
            (filt if e.status == "filtered" else rej)[e.reason] += 1
        for v in e.seqs:
            c["tokens"] += len(v.ids)
            c["trained"] += int(v.trained.sum())
            c["truncated_tokens"] += v.truncated
            c["truncated_docs"] += bool(v.truncated)
            k = int(np.searchsorted(HIST_EDGES, len(v.ids)))
            hist[f"<={HIST_EDGES[k]}" if k < len(HIST_EDGES) else f">{HIST_EDGES[-1]}"] += 1
            outside = "template" if v.roles else "text"  # tokens outside any message, named as in stats.json
            for k in range(len(v.ids)):
                role = v.role(k) or outside
                roles[role] += 1
                troles[role] += bool(v.trained[k])
    tokens = c["tokens"]
    return {"records_read": len(entries) - c["excluded"], "records_kept": c["kept"],
            "records_filtered": c["filtered"], "records_rejected": c["rejected"],
            "filtered_by_reason": dict(filt), "rejected_by_reason": dict(rej), "tokens": tokens,
            "trained_tokens": c["trained"], "supervised_share": c["trained"] / tokens if tokens else None,
            "truncated_tokens": c["truncated_tokens"], "truncated_docs": c["truncated_docs"],
            "tokens_per_role": dict(roles), "trained_tokens_per_role": {k: v for k, v in troles.items() if v},
            "doc_length_histogram": dict(hist)}
