"""Stage fingerprints: a stage is up to date when nothing it depends on has changed.

fingerprint = sha256 of a canonical JSON of
  - the stage kind and its code version (sha256 of the source files of the kind's modules: an edit
    to the code that runs the stage reruns it);
  - its own options, as validated (defaults included, so a changed default counts too);
  - the contents of its input files (sha256, whatever their timestamps);
  - for each stage it reads, that stage's fingerprint and the id of the output it produced
    (`output_id`, new on every completed run): so when an upstream stage reran, for a changed
    option or by --force, everything that read its output reruns too, and nothing before it does;
  - for a reference given as a path (a tokenizer directory), the contents of that path.

Paths appear as written (relative to the recipe), so moving a checkout keeps every stage current.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from astrai.runtime import file_sha256

def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def path_digest(path: Path, skip: Iterable[str] = ("__pycache__",)) -> str:
    """A file's sha256, or for a directory the sha256 over its files' relative names and contents."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not set(p.relative_to(path).parts) & set(skip)):
        h.update(str(f.relative_to(path).as_posix()).encode() + b"\0" + file_sha256(f).encode() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=None)
def code_version(modules: tuple[str, ...]) -> str:
    """sha256 over the source files of the given modules (a package counts with all its .py files)."""
    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ValueError(f"code version: module {name} not found")
        if spec.submodule_search_locations:
            files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).rglob("*.py"))
        else:
            files = [Path(spec.origin)]
        for f in files:
            h.update(name.encode() + b"\0" + f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def input_digests(patterns: Iterable[str], base_dir: Path) -> list[list[str]]:
    """[[pattern, matched file relative to base_dir (or as given), sha256], ...] in a fixed order."""
    import glob

    out = []
    for pattern in patterns:
        hits = sorted(glob.glob(str(base_dir / pattern))) or sorted(glob.glob(pattern))
        for hit in hits:
            p = Path(hit)
            try:
                shown = p.resolve().relative_to(base_dir.resolve()).as_posix()
            except ValueError:
                shown = hit
            out.append([pattern, shown, path_digest(p)])
    return out


def stage_fingerprint(kind: str, code: str, options: dict, files: dict, upstream: dict) -> str:
    payload = {"kind": kind, "code": code, "options": options, "files": files, "upstream": upstream}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- what a finished stage left: a stamp checked before the stage counts as up to date ----------

# Never part of a stage's product: temporaries and markers (dot names) and the Arrow caches that
# reading preprocessed data builds beside it; a kind may name more (`unstamped`: the report
# `astrai eval` writes beside the model it read).
def _ignored(rel: Path, names: tuple[str, ...]) -> bool:
    return any(p.startswith(".") or p == "cache" for p in rel.parts[:-1]) or rel.name.startswith(".") \
        or rel.name in names


def _stamped(output: Path, parts: tuple[str, ...], names: tuple[str, ...] = ()) -> dict[str, Path]:
    roots = [output / p for p in parts] if parts else [output]
    files = []
    for r in roots:
        if r.is_file():
            files.append(r)
        elif r.is_dir():
            files.extend(f for f in r.rglob("*") if f.is_file())
    return {f.relative_to(output).as_posix(): f for f in sorted(files) if not _ignored(f.relative_to(output), names)}


def _stat(f: Path) -> list[int]:
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def output_stamp(output: Path, parts: tuple[str, ...] = (), names: tuple[str, ...] = ()) -> dict[str, list]:
    """{relative path: [size, mtime_ns, ctime_ns, inode, sha256]} of the files a stage produced
    (`parts`: only these subpaths of its output; empty: all of it; files called one of `names` left out)."""
    return {rel: _stat(f) + [file_sha256(f)] for rel, f in _stamped(Path(output), parts, names).items()}


def output_changes(output: Path, parts: tuple[str, ...], recorded, names: tuple[str, ...] = ()) -> "str | None":
    """The first difference between the output now and its recorded stamp, or None. As git's index
    does: a file whose size, times and inode all match is unchanged (ctime cannot be set back by
    hand); any other is hashed and compared, so a copy with the same bytes still counts as unchanged."""
    if not isinstance(recorded, dict):
        return "its record in stage.json is unreadable"
    now = _stamped(Path(output), parts, names)
    for rel, rec in recorded.items():
        f = now.get(rel)
        if f is None:
            return f"{rel} was removed"
        if not (isinstance(rec, list) and len(rec) == 5):
            return f"the record of {rel} is unreadable"
        st = _stat(f)
        if st != rec[:4] and (st[0] != rec[0] or file_sha256(f) != rec[4]):
            return f"{rel} was changed"
    added = sorted(set(now) - set(recorded))
    return f"{added[0]} was added" if added else None
