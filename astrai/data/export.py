"""`astrai export OUT --to hf|jsonl|parquet DEST`: hand a preprocessed dataset to other tools.

- hf: a Hugging Face `save_to_disk` directory (`datasets.load_from_disk(DEST)`).
- jsonl: one JSON object per row, with the decoded text of each document next to its ids and the
  trained text (labels != -100) so a person can read what will be trained.
- parquet: the same rows re-sharded to `--rows-per-shard` rows per file.

Rows stream shard by shard; nothing holds the whole dataset. Outputs are written under a
temporary name and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq

from astrai.errors import InputError
from astrai.schema import IGNORE_INDEX, INPUT_IDS, LABELS, SEQ_LENS


def _shards(out: Path) -> list[Path]:
    manifest = out / "manifest.json"
    if not manifest.exists():
        raise InputError(f"{out}: no manifest.json; export needs a finished `astrai preprocess` output")
    return [out / s for s in json.loads(manifest.read_text())["shards"]]


def export(out: str, to: str, dest: str, rows_per_shard: int = 100_000, tokenizer: Optional[str] = None) -> int:
    outp, destp = Path(out), Path(dest)
    if destp.exists():
        raise InputError(f"{dest} exists; export writes a new path")
    shards = _shards(outp)
    tmp = destp.with_name(f".{destp.name}.tmp-{os.getpid()}")
    try:
        if to == "hf":
            n = _to_hf(shards, tmp)
        elif to == "jsonl":
            n = _to_jsonl(outp, shards, tmp, tokenizer)
        elif to == "parquet":
            n = _to_parquet(shards, tmp, rows_per_shard)
        else:
            raise InputError(f"--to {to!r}: expected hf, jsonl or parquet")
        os.replace(tmp, destp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise
    return n


def _to_hf(shards: list[Path], tmp: Path) -> int:
    import datasets

    ds = datasets.Dataset.from_parquet([str(s) for s in shards]) if shards else datasets.Dataset.from_dict({})
    ds.save_to_disk(str(tmp))
    return len(ds)


def _to_parquet(shards: list[Path], tmp: Path, rows_per_shard: int) -> int:
    import pyarrow as pa

    tmp.mkdir(parents=True)
    k, n, pending, pending_rows = 0, 0, [], 0

    def flush():
        nonlocal k, pending, pending_rows
        if pending:
            pq.write_table(pa.concat_tables(pending), tmp / f"part-{k:05d}.parquet", compression="zstd")
            k, pending, pending_rows = k + 1, [], 0

    for s in shards:
        for batch in pq.ParquetFile(s).iter_batches(batch_size=1024):
            table = pa.Table.from_batches([batch])
            while table.num_rows:
                take = min(rows_per_shard - pending_rows, table.num_rows)
                pending.append(table.slice(0, take))
                pending_rows += take
                n += take
                table = table.slice(take)
                if pending_rows == rows_per_shard:
                    flush()
    flush()
    return n


def _to_jsonl(outp: Path, shards: list[Path], tmp: Path, tokenizer: Optional[str]) -> int:
    from astrai.text.tokenizer import load_tokenizer, with_added_tokens

    manifest = json.loads((outp / "manifest.json").read_text())
    tok = load_tokenizer(tokenizer or manifest["tokenizer"]["path"])
    tok = with_added_tokens(tok, manifest["pipeline"].get("added_tokens") or [])
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for s in shards:
            for batch in pq.ParquetFile(s).iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    if INPUT_IDS in row:
                        row["docs"] = _decode_docs(tok, row)
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                    n += 1
    return n


def _decode_docs(tok, row) -> list[dict]:
    docs, start = [], 0
    labels = row.get(LABELS)
    for length in row[SEQ_LENS]:
        ids = row[INPUT_IDS][start:start + length]
        doc = {"text": tok.decode(ids)}
        if labels is not None:
            lab = labels[start:start + length]
            doc["trained_text"] = tok.decode([t for t, l in zip(ids, lab) if l != IGNORE_INDEX])
        docs.append(doc)
        start += length
    return docs
