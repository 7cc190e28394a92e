"""Dataset mode: rows of a preprocess output directory, as written.

A row is a bin (single output: input_ids, labels, position_ids, seq_lens), shown with its
documents from seq_lens, or a multi-output row ({source}_input_ids, {source}_labels, value
columns). Tokens are decoded with the tokenizer recorded in manifest.json plus the pipeline's
added_tokens (with a warning when its fingerprint differs); position ids are checked against the
writer's rule; the statistics are stats.json's, and the first lines of rejects.jsonl become notes.

Only what is shown is read: rows are counted by the shards' metadata, and each comes from the one
row group that holds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from astrai.errors import InputError
from astrai.data.inspect.tokens import TokenText
from astrai.data.inspect.views import Entry, Report, shortest_floats
from astrai.schema import (
    IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS, SEQ_LENS, TOKEN_COLUMNS, is_source_token_column, source_column,
    source_of_column,
)


def dataset_report(out: Path, wanted: list[int], tokenizer: Optional[str], explicit: bool = False) -> Report:
    from astrai.text.tokenizer import load_tokenizer, with_added_tokens

    man_path = out / "manifest.json"
    if not man_path.exists():
        why = "preprocess has not finished (rerun it)" if (out / ".work").exists() else "not a preprocess output"
        raise InputError(f"{out}: no manifest.json: {why}")
    manifest = json.loads(man_path.read_text(encoding="utf-8"))
    stats = json.loads((out / "stats.json").read_text(encoding="utf-8")) if (out / "stats.json").exists() else {}
    pipe = manifest.get("pipeline") or {}
    recorded = manifest.get("tokenizer") or {}
    spec = tokenizer or recorded.get("path")
    if not spec:
        raise InputError(f"{man_path} names no tokenizer: pass --tokenizer DIR")
    try:
        tok = load_tokenizer(spec, Path.cwd())
    except InputError as e:
        raise InputError(f"{e} (the tokenizer recorded in {man_path}; pass --tokenizer DIR)") from None
    notes = []
    if tok.fingerprint != recorded.get("fingerprint"):
        notes.append(f"warning: tokenizer {tok.path} is not the one the dataset was written with (fingerprint "
                     f"differs): token texts may be wrong")
    tt = TokenText(with_added_tokens(tok, pipe.get("added_tokens") or []))
    entries = list(_dataset_rows(out, manifest, wanted, tt))
    if explicit and len(entries) < len(wanted):
        import pyarrow.parquet as pq

        total = sum(pq.ParquetFile(out / s).metadata.num_rows for s in manifest.get("shards", []))
        found = {e.index for e in entries}
        notes += [f"row {k}: not in the dataset (it has {total} rows)" for k in wanted if k not in found]
    notes += _rejects_excerpt(out / "rejects.jsonl")
    return Report(str(out), str(out), entries, stats, [], notes, is_dataset=True)


def _dataset_rows(out: Path, manifest: dict, wanted: list[int], tt: TokenText) -> Iterator[Entry]:
    """Rows by global index (shards in manifest order), reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    pipe = manifest.get("pipeline") or {}
    want, base = sorted(wanted), 0
    for shard in manifest.get("shards", []):
        pf = pq.ParquetFile(out / shard)
        for g in range(pf.metadata.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            here = [k for k in want if base <= k < base + rows]
            if here:
                table = pf.read_row_group(g)
                for k in here:
                    row = table.slice(k - base, 1).to_pylist()[0]
                    where = f"{shard} row {k - base}"
                    yield _bin_entry(row, k, where, pipe, tt) if INPUT_IDS in row else _row_entry(row, k, where,
                                                                                                    pipe, tt)
            base += rows
            want = [k for k in want if k >= base]
            if not want:
                return


def _bin_entry(row: dict, index: int, where: str, pipe: dict, tt: TokenText) -> Entry:
    from astrai.data.write import positions

    ids, labels = row[INPUT_IDS], row.get(LABELS)
    trained = np.ones(len(ids), bool) if labels is None else np.asarray(labels) != IGNORE_INDEX
    seq_lens = [int(x) for x in (row.get(SEQ_LENS) or [len(ids)])]
    pos = None if row.get(POSITION_IDS) is None else np.asarray(row[POSITION_IDS], dtype=np.int64)
    pp = pipe.get("preprocessing") or {}
    packed = pp.get("max_packed_len") or pp.get("max_seq_len")
    packed = packed if pp.get("packing_strategy", "none") != "none" else None
    e = Entry("bin", index, where, "written", seq_lens=seq_lens, capacity=packed)
    docs = np.repeat(np.arange(len(seq_lens)), seq_lens)
    docs = docs if len(docs) == len(ids) else np.zeros(len(ids), np.int64)  # inconsistent row: warned below
    e.seqs.append(tt.view(ids, trained, pos, docs, is_bin=True))
    e.values = shortest_floats({k: v for k, v in row.items() if k not in TOKEN_COLUMNS})
    mode = (pipe.get("output") or {}).get("position_ids_mode", "doc_reset")
    if sum(seq_lens) != len(ids):
        e.notes.append(f"warning: seq_lens sum to {sum(seq_lens)} but the row has {len(ids)} tokens")
    elif pos is not None:  # the writer's own rule, as a check on what was written
        expect = positions(np.asarray(seq_lens, dtype=np.int64), mode)
        if expect is not None and not np.array_equal(expect, pos):
            bad = int(np.flatnonzero(expect != pos)[0]) if len(expect) == len(pos) else 0
            e.notes.append(f"warning: position ids differ from {mode} from token {bad} on")
    return e


def _row_entry(row: dict, index: int, where: str, pipe: dict, tt: TokenText) -> Entry:
    """A multi-output row: {source}_input_ids (+ {source}_labels; nested for list sources), value columns."""
    e = Entry("row", index, where, "written")
    secs = (pipe.get("input") or {}).get("sources") or {}
    # the writer's rule: no labels column = all trained for plain text, all masked for a prompt-only source
    has_labels = any(s.get("template") or s.get("action") == "mask" for src in secs.values() for s in src["sections"])

    def is_answer(name):
        return any(s.get("action") in ("train", "$role") for s in (secs.get(name) or {}).get("sections", []))

    # context before answers (a GRPO prompt before its completions); the manifest's pipeline has sorted keys
    for name in sorted(set(filter(None, map(source_of_column, row))), key=lambda n: (is_answer(n), n)):
        sections = (secs.get(name) or {}).get("sections", [])
        if sections and all(s.get("action") == "value" for s in sections):
            continue  # a value-only source (rewards): its values are shown with the row
        trains = any(s.get("action") in ("train", "$role") for s in sections) and not has_labels
        ids, labels = row[source_column(name, INPUT_IDS)], row.get(source_column(name, LABELS))
        nested = bool(ids) and isinstance(ids[0], list)
        pairs = list(zip(ids, labels or [None] * len(ids))) if nested else [(ids, labels)]
        for j, (one, lab) in enumerate(pairs):
            trained = np.asarray(lab) != IGNORE_INDEX if lab is not None else np.full(len(one), trains)
            e.seqs.append(tt.view(one, trained, None, np.zeros(len(one), np.int64), source=name,
                                  item=j if nested else None))
    e.values = shortest_floats({k: v for k, v in row.items() if not is_source_token_column(k)})
    return e


def _rejects_excerpt(path: Path, n: int = 5) -> list[str]:
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if k == n:
                return out + ["rejected: ... (more in rejects.jsonl)"]
            r = json.loads(line)
            key = f"{r['key']}: " if r.get("key") else ""
            out.append(f"rejected: {r.get('file')}:{r.get('line')}: {key}{r.get('detail')} [{r.get('reason')}]")
    return out
