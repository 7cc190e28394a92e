"""Load preprocessed shards back for training: a torch Dataset over memory-mapped Arrow.

`ShardDataset(out_dir)` reads manifest.json, verifies each shard against what the manifest recorded
when it was written (size and row count every time; the full sha256 whenever its cache is built:
astrai.data.shard_check), converts it once into an Arrow IPC file under `out_dir/cache/`
(atomically; the same conversion `datasets` does, keyed by the shard's digest and stat stamps, so a
stale cache is never read) and memory-maps it, so rows are read on demand and the dataset is never
loaded whole. Single-output rows come back as
int64 tensors `input_ids`, `labels` (a copy of input_ids when the dataset has no labels column:
plain pretraining), `position_ids` (rebuilt per document from seq_lens when the column was not
written) and `seq_lens`. DPO/GRPO rows come back as records (dicts of lists), as written.

Collate functions:
- `collate_padded`: one document per row, right-padded, with attention_mask. Packed rows are first
  split back into their documents (so a padded batch never lets documents see each other).
- `collate_packed`: all documents of the batch concatenated into one row with `cu_seqlens` and
  `max_seqlen` for varlen attention, position ids as written (doc_reset: restarting per document). The label of each
  document's first token is set to -100: with labels shifted inside the model, that position
  would otherwise be predicted from the previous document's last token.

NOTE: torch is imported here and only here in astrai.data (import astrai.data stays torch-free).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from astrai.data.shard_check import check_digest, check_shard, shard_checks, stat_stamp
from astrai.data.write import positions
from astrai.errors import InputError, read_text_regular
from astrai.runtime import atomic_write_text, fresh_tmp, refuse_link
from astrai.schema import IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS, SEQ_LENS



def _arrow_cache(out: Path, shard: str, record: dict) -> Path:
    """The shard as an Arrow IPC file under cache/, named by the shard's recorded digest and trusted
    only while both files keep the stat stamps written beside it (astrai.data.shard_check): any
    change rebuilds it, and a rebuild first hashes the shard against the manifest. A stale cache
    (the shard edited since, or the cache itself) is never read."""
    source = check_shard(out, shard, record)
    cache = out / "cache" / f"{Path(shard).stem}-{record['sha256'][:16]}.arrow"
    stamp_file = cache.with_suffix(".stamp.json")
    try:
        stamps = json.loads(stamp_file.read_text())
        if stamps == {"source": stat_stamp(source), "arrow": stat_stamp(cache)}:
            return cache
    except (OSError, ValueError):
        pass
    refuse_link(cache.parent, directory=True)  # the cache is never written through a planted link
    cache.parent.mkdir(parents=True, exist_ok=True)
    for old in cache.parent.glob(f"{Path(shard).stem}*"):  # caches of other versions of this shard
        if old not in (cache, stamp_file) and old.name.startswith((f"{Path(shard).stem}.", f"{Path(shard).stem}-")):
            old.unlink(missing_ok=True)
    before = stat_stamp(source)
    check_digest(source, record)
    tmp = fresh_tmp(cache)  # a link planted at the name is removed, not written through
    pf = pq.ParquetFile(source)
    with pa.OSFile(str(tmp), "wb") as sink:
        with pa.ipc.new_file(sink, pf.schema_arrow) as writer:
            for i in range(pf.num_row_groups):
                writer.write_table(pf.read_row_group(i))
    if stat_stamp(source) != before:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{source}: changed while it was read; retry once nothing writes it")
    os.replace(tmp, cache)
    atomic_write_text(stamp_file, json.dumps({"source": before, "arrow": stat_stamp(cache)}))
    return cache


POSITION_MODES = ("none", "doc_reset", "continuous")


def read_manifest(out: Path) -> dict:
    """manifest.json of a preprocess output, checked for what loading reads: every problem is an
    InputError naming the directory or file and the key. Where each shard is and what it holds is
    checked by astrai.data.shard_check (a path outside data/ is refused, never read)."""
    if not out.is_dir():
        raise InputError(f"data {out}: " + ("not a directory" if out.exists() else "no such directory")
                         + "; give the output directory of `astrai preprocess` (manifest.json, data/*.parquet)")
    path = out / "manifest.json"
    if not path.exists():
        raise InputError(f"data {out}: no manifest.json, so not a finished `astrai preprocess` output (run "
                         f"`astrai preprocess PIPELINE -i INPUT -o {out}` first, or let it finish)")
    try:
        man = json.loads(read_text_regular(path, "manifest", 64 << 20))
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (a manifest is written by astrai; rerun "
                         f"preprocess)") from None
    shards = man.get("shards") if isinstance(man, dict) else None
    if not isinstance(shards, list) or not all(isinstance(x, str) and x for x in shards):
        raise InputError(f"{path}: 'shards' must be a list of shard paths (damaged manifest; rerun preprocess)")
    pipeline, tok = man.get("pipeline"), man.get("tokenizer")
    if not isinstance(pipeline, dict) or not isinstance(pipeline.get("output", {}), dict):
        raise InputError(f"{path}: 'pipeline' must be the pipeline's options (damaged manifest; rerun preprocess)")
    if not isinstance(tok, dict) or not isinstance(tok.get("path"), str):
        raise InputError(f"{path}: 'tokenizer.path' is missing (damaged manifest; rerun preprocess)")
    mode = pipeline.get("output", {}).get("position_ids_mode", "doc_reset")
    if mode not in POSITION_MODES:
        raise InputError(f"{path}: pipeline.output.position_ids_mode {mode!r} is not one of "
                         f"{', '.join(POSITION_MODES)} (damaged manifest; rerun preprocess)")
    return man


class ShardDataset:
    """Map-style dataset over an astrai output directory (works as a torch Dataset)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(out_dir)
        self.manifest = read_manifest(self.out)
        checks = shard_checks(self.out, self.manifest)  # where each shard is, its size, rows and digest
        self.tables = []
        for shard in self.manifest["shards"]:
            try:
                mm = pa.memory_map(str(_arrow_cache(self.out, shard, checks[shard])))
                table = pa.ipc.open_file(mm).read_all()  # zero-copy over the mapping
            except (pa.ArrowException, OSError) as e:
                if isinstance(e, OSError) and e.errno is not None:
                    raise  # the disk (full, unreadable): reported as such
                raise InputError(f"{self.out / shard}: cannot read the shard ({' '.join(str(e).split())}); "
                                 f"rerun preprocess") from None
            if table.num_rows != checks[shard]["rows"]:
                raise InputError(f"{self.out / 'cache'}: the cache of {shard} has {table.num_rows} rows, the manifest "
                                 f"{checks[shard]['rows']}; delete {self.out / 'cache'} and retry")
            self.tables.append(table)
        counts = [t.num_rows for t in self.tables]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.columns = self.tables[0].column_names if self.tables else []
        self.multi = INPUT_IDS not in self.columns and bool(self.columns)
        self.position_mode = self.manifest["pipeline"].get("output", {}).get("position_ids_mode", "doc_reset")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _row(self, i: int) -> dict:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        t = self.tables[s]
        r = i - int(self.offsets[s])
        return {c: t.column(c)[r] for c in self.columns}

    def values(self, i: int) -> dict:
        """Row i's value columns (an answer, a reward: what a pipeline's value sections wrote), as Python
        values; the token columns are left out."""
        row = self._row(i)
        return {k: v.as_py() for k, v in row.items() if k not in (INPUT_IDS, LABELS, POSITION_IDS, SEQ_LENS)}

    def __getitem__(self, i: int) -> dict:
        import torch

        row = self._row(i)
        if self.multi:
            return {k: v.as_py() for k, v in row.items()}
        ids = torch.from_numpy(row[INPUT_IDS].values.to_numpy(zero_copy_only=False).astype(np.int64))
        seq_lens = torch.from_numpy(row[SEQ_LENS].values.to_numpy(zero_copy_only=False).astype(np.int64))
        labels = (torch.from_numpy(row[LABELS].values.to_numpy(zero_copy_only=False).astype(np.int64))
                  if LABELS in row else ids.clone())
        if POSITION_IDS in row:
            pos = torch.from_numpy(row[POSITION_IDS].values.to_numpy(zero_copy_only=False).astype(np.int64))
        else:
            pos = torch.from_numpy(positions(seq_lens.numpy(), "doc_reset").astype(np.int64))
        return {INPUT_IDS: ids, LABELS: labels, POSITION_IDS: pos, SEQ_LENS: seq_lens}


def split_documents(row: dict) -> list[dict]:
    """A packed row back into its documents (positions restart at 0 in each)."""
    import torch

    out = []
    start = 0
    for n in row["seq_lens"].tolist():
        out.append({"input_ids": row["input_ids"][start:start + n], "labels": row["labels"][start:start + n],
                    "position_ids": torch.arange(n)})
        start += n
    return out


def collate_padded(batch: list[dict], pad_id: int = 0, max_len: Optional[int] = None) -> dict:
    import torch

    docs = [d for row in batch for d in split_documents(row)]
    length = max(len(d["input_ids"]) for d in docs)
    if max_len is not None:
        length = min(length, max_len)
    n = len(docs)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    labels = torch.full((n, length), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, d in enumerate(docs):
        k = min(len(d["input_ids"]), length)
        ids[i, :k] = d["input_ids"][:k]
        labels[i, :k] = d["labels"][:k]
        pos[i, :k] = d["position_ids"][:k]
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask}


def collate_packed(batch: list[dict]) -> dict:
    import torch

    ids = torch.cat([r["input_ids"] for r in batch])
    labels = torch.cat([r["labels"] for r in batch]).clone()
    seq_lens = torch.cat([r["seq_lens"] for r in batch])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    labels[cu[:-1].long()] = IGNORE_INDEX  # never predict a document's first token from the previous document
    pos = torch.cat([r["position_ids"] for r in batch])  # as written (doc_reset unless configured otherwise)
    return {"input_ids": ids[None], "labels": labels[None], "position_ids": pos[None],
            "cu_seqlens": cu, "max_seqlen": int(seq_lens.max()) if len(seq_lens) else 0}
