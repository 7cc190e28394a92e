"""What manifest.json records of each shard at write time, and how a reader verifies it.

The manifest's `shard_checks` holds, per shard (relative path -> record): its size in bytes, its
row count and the sha256 of its bytes. Verifying costs:
- always (every time a dataset is opened, and before preprocess says "up to date"): the size (one
  stat) and the row count (the Parquet footer); a shard cut short, appended to or rewritten with
  other rows is refused there;
- the full sha256 whenever a shard is read into its Arrow cache (astrai.data.load): on first use,
  and again after any change of the shard's or the cache's size, times or inode. ctime is among
  them and cannot be set back by hand, so a shard edited in place with its size and mtime restored
  is still hashed, and refused, before anything reads it.
A shard path must lie inside the dataset's data/ folder: a manifest naming another file is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from astrai.errors import InputError
from astrai.runtime import file_sha256

def stat_stamp(path: Path) -> list[int]:
    """What changes whenever the file's bytes may have: size, mtime, ctime (not settable), inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def shard_record(path: Path) -> dict:
    """The manifest's record of a finished shard."""
    return {"bytes": os.path.getsize(path), "rows": parquet_rows(path), "sha256": file_sha256(path)}


def shard_path(out: Path, shard) -> Path:
    """The shard's file, refused unless it lies in the dataset's data/ folder."""
    if not isinstance(shard, str):
        raise InputError(f"{out / 'manifest.json'}: shard {shard!r} is not a path")
    path = (out / shard)
    if path.resolve().parent != (out / "data").resolve() or not path.name.endswith(".parquet"):
        raise InputError(f"{out / 'manifest.json'}: shard '{shard}' is not a .parquet file in {out / 'data'}; "
                         f"the manifest was edited: run astrai preprocess again")
    return path


def check_shard(out: Path, shard: str, record) -> Path:
    """The cheap check (size + row count); returns the shard's path."""
    path = shard_path(out, shard)
    fix = "the shard was changed after preprocessing: run astrai preprocess again (or restore it)"
    if not isinstance(record, dict) or not all(isinstance(record.get(k), t) for k, t in
                                               (("bytes", int), ("rows", int), ("sha256", str))):
        raise InputError(f"{out / 'manifest.json'}: no valid check for shard '{shard}' (bytes, rows, sha256): "
                         f"made by an older astrai or edited; run astrai preprocess again")
    if path.exists() and not path.is_file():
        raise InputError(f"{path}: not a regular file: {fix}")
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise InputError(f"{path}: {e.strerror or e}; the dataset is incomplete: run astrai preprocess again") from None
    if size != record["bytes"]:
        raise InputError(f"{path}: {size} bytes, the manifest records {record['bytes']}: {fix}")
    try:
        rows = parquet_rows(path)
    except Exception as e:  # a damaged footer: whatever pyarrow raises, one line
        raise InputError(f"{path}: not a readable Parquet file ({e}): {fix}") from None
    if rows != record["rows"]:
        raise InputError(f"{path}: {rows} rows, the manifest records {record['rows']}: {fix}")
    return path


def check_digest(path: Path, record: dict):
    digest = file_sha256(path)
    if digest != record["sha256"]:
        raise InputError(f"{path}: its content differs from the manifest's digest ({digest[:12]} vs "
                         f"{record['sha256'][:12]}): the shard was changed after preprocessing: run astrai "
                         f"preprocess again (or restore it)")


def shard_checks(out: Path, manifest: dict) -> dict:
    """The manifest's checks, one per listed shard (refused when missing: an older astrai's manifest)."""
    checks = manifest.get("shard_checks")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not isinstance(checks, dict) or set(checks) != set(map(str, shards)):
        raise InputError(f"{out / 'manifest.json'}: no shard checks for its shards (made by an older astrai, or "
                         f"edited); run astrai preprocess again to rewrite it")
    return checks


def verify_cheap(out: Path, manifest: dict) -> bool:
    """True when every listed shard has its recorded size and row count (preprocess's up-to-date test)."""
    try:
        checks = shard_checks(out, manifest)
        for shard in manifest["shards"]:
            check_shard(out, shard, checks[shard])
    except InputError:
        return False
    return True
