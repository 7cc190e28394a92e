"""Readers: JSONL, JSON (one object or a list), Parquet, and saved Hugging Face dataset directories.

Inputs are split into partitions, the unit of parallel work and of resume. Partitions depend only
on the input files and `partition_bytes` (never on the number of workers), so the same inputs
always give the same partitions, in the same order, with the same names:

- JSONL: byte ranges of about partition_bytes, each starting at a line start;
- Parquet: runs of whole row groups of about partition_bytes;
- HF dataset directory (save_to_disk, also one found inside a walked directory): one partition
  per Arrow file (a DatasetDict of splits is refused: pass the split's directory);
- JSON: the whole file (a JSON document cannot be split without parsing it); a .json file that
  holds JSON Lines is read line by line, with line numbers.

Reading a partition yields batches of (record, where) pairs, where `where` is "LINE" for
line-based files and "record N"/"row N" otherwise; a bad record comes back as a RecordError in
place of the record so the caller decides (raise or skip) and counts it. A line longer than
`max_record_bytes` is such a record (record_too_large), passed over unread (astrai.data.lines). With `keep(position)`
(astrai.data.holdout) only some records are read; JSONL lines it skips are not even parsed. Memory is bounded by
one batch (plus one row group or Arrow batch), whatever the input size.
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from astrai.config.pipeline import Preprocessing
from astrai.data.holdout import position
from astrai.data.lines import TOO_DEEP, LongLine, bounded_lines, parse_json_line, records, skip_line, too_long
from astrai.data.streams import open_stream
from astrai.errors import InputError, RecordError, open_regular, regular_file
from astrai.runtime import inside_output

SUFFIX_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
                ".jsonl.gz": "jsonl.gz", ".ndjson.gz": "jsonl.gz",
                ".jsonl.zst": "jsonl.zst", ".ndjson.zst": "jsonl.zst"}
MAX_RECORD_BYTES = Preprocessing.model_fields["max_record_bytes"].default


@dataclass(frozen=True)
class Partition:
    index: int  # position in the global partition order (names intermediate files and shards)
    file: str
    kind: str  # jsonl | jsonl.gz | jsonl.zst | json | parquet | arrow
    start: int  # jsonl: byte offset; parquet: first row group; arrow/json: 0
    end: int  # jsonl: byte offset (exclusive); parquet: last row group (exclusive); else -1
    # how the first record is located in errors: jsonl: the 1-based line number of the byte at
    # `start`; parquet: the 0-based row number of its first row group (rows are counted from 0)
    first_where: int = 1

    @property
    def name(self) -> str:
        return f"p{self.index:05d}"


def expand_inputs(patterns: list[str], base_dir: Optional[Union[str, Path]] = None,
                  exclude: Optional[Path] = None, warnings: Optional[list] = None) -> list[Path]:
    """Files for the given paths/globs, sorted within each pattern; HF dataset dirs stay whole, also
    inside a directory that is walked (their state.json/dataset_info.json are not records).

    Outputs are never inputs: nothing under `exclude` (the run's own output directory) is read, and
    a glob or walked directory skips every directory that carries astrai's output marker.
    What a person would want to know is appended to `warnings` (one line each): files of a walked
    directory that are not inputs (README.md, .txt), a directory with no input file, an empty file.
    Nothing to read at all is an error."""
    warnings = [] if warnings is None else warnings
    out: list[Path] = []
    for pat in patterns:
        p = Path(pat).expanduser()
        if not p.is_absolute() and base_dir is not None:
            p = Path(base_dir) / p
        matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True)) if glob.has_magic(str(p)) else [p]
        if not matches or not matches[0].exists():
            raise InputError(f"input '{pat}': no such file or directory ({p})")
        matches = [m for m in matches if not inside_output(m, exclude)]
        if not matches:
            raise InputError(f"input '{pat}': only matches astrai's own output ({exclude}); outputs are never read "
                             f"as input")
        for m in matches:
            if m.is_dir() and not _is_hf_dir(m):
                skipped: list[Path] = []
                found = [f for f in _dir_inputs(pat, m, skipped) if not inside_output(f, exclude)]
                skipped = [f for f in skipped if not inside_output(f, exclude)]
                if skipped:
                    names = [str(f.relative_to(m)) for f in skipped]
                    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
                    warnings.append(f"input '{pat}': skipped {len(names)} file(s) that are not "
                                    f"{'/'.join(_INPUT_SUFFIXES)}: {', '.join(names[:10])}{more}")
                if not found:
                    warnings.append(f"input '{pat}': directory {m} has no input files (.jsonl, .json, .parquet, "
                                    f".jsonl.gz, .jsonl.zst or a saved Hugging Face dataset)")
                out.extend(found)
            else:  # a saved dataset directory, or a regular file (never a FIFO or a device: refused)
                if not m.is_dir() and regular_file(m, f"input '{pat}':").stat().st_size == 0:
                    warnings.append(f"input {m} is empty")
                out.append(m)
    if not out:
        raise InputError(f"no input files in {', '.join(repr(p) for p in patterns)}: expected .jsonl, .json, "
                         f".parquet, .jsonl.gz, .jsonl.zst files or a saved Hugging Face dataset")
    return out


_INPUT_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".jsonl.zst")


def _suffix(p: Path) -> str:
    """'.jsonl.gz' for compressed inputs, else the last suffix (lower case)."""
    two = "".join(p.suffixes[-2:]).lower()
    return two if two in SUFFIX_KINDS else p.suffix.lower()


def _dir_inputs(pat: str, d: Path, skipped: Optional[list] = None) -> list[Path]:
    """Data files and saved datasets under d, sorted (a path sorts before what lies under it); other
    files are appended to `skipped`."""
    _refuse_dataset_dict(pat, d)
    datasets: list[Path] = []
    files: list[Path] = []
    for f in sorted(d.rglob("*")):
        if datasets and datasets[-1] in f.parents:
            continue  # inside a saved dataset: its Arrow files are read through its state.json
        if f.is_dir():
            _refuse_dataset_dict(pat, f)
            if _is_hf_dir(f):
                datasets.append(f)
        elif _suffix(f) in SUFFIX_KINDS and f.is_file():  # a FIFO or device named x.jsonl is skipped
            files.append(f)
        elif skipped is not None:
            skipped.append(f)
    return sorted(datasets + files)


def _refuse_dataset_dict(pat: str, d: Path):
    # save_to_disk of a DatasetDict: one saved dataset per split under a dataset_dict.json. Reading
    # them all would mix test data into training; which split to use is the user's call.
    if (d / "dataset_dict.json").exists():
        splits = sorted(p.name for p in d.iterdir() if _is_hf_dir(p))
        raise InputError(f"input '{pat}': {d} is a saved DatasetDict (splits: {', '.join(splits)}); pass one "
                         f"split's directory, e.g. {d / (splits[0] if splits else 'train')}")


def _is_hf_dir(p: Path) -> bool:
    return (p / "state.json").exists() and (p / "dataset_info.json").exists()


def _kind(p: Path) -> str:
    if p.is_dir():
        return "arrow"
    kind = SUFFIX_KINDS.get(_suffix(p))
    if kind is None:
        raise InputError(f"input {p}: unknown format '{p.suffix}' (expected .jsonl, .json, .parquet, .jsonl.gz, "
                         f".jsonl.zst or a save_to_disk directory)")
    return kind


def plan_partitions(files: list[Path], partition_bytes: int, digests: Optional[dict] = None) -> list[Partition]:
    """Partitions of the inputs. JSONL files are read once to find line starts; with `digests`, their
    sha256 is taken in that same pass (digests[path] = hex), so the fingerprint needs no second read."""
    parts: list[Partition] = []
    for f in files:
        kind = _kind(f)
        try:
            _plan_file(f, kind, partition_bytes, digests, parts)
        except InputError:
            raise
        except Exception as e:  # pyarrow and OS errors do not always name the file; this one does
            raise _unreadable(f, e) from e
    return parts


def _unreadable(f, e: Exception) -> InputError:
    why = " ".join(str(e).split())  # pyarrow's messages span lines: one line for the person
    return InputError(f"input {f}: cannot read it ({type(e).__name__}: {why}); is the file complete and in "
                      f"the format its name says?")


def _plan_file(f: Path, kind: str, partition_bytes: int, digests: Optional[dict], parts: list[Partition]):
    """Append one file's partitions to parts."""
    if kind == "jsonl":
        h = hashlib.sha256() if digests is not None else None
        for start, end, line in _jsonl_ranges(f, partition_bytes, h):
            parts.append(Partition(len(parts), str(f), kind, start, end, line))
        if h is not None:
            digests[str(f)] = h.hexdigest()
    elif kind == "parquet":
        import pyarrow.parquet as pq

        md = pq.ParquetFile(f).metadata
        g0, size, row0, rows = 0, 0, 0, 0
        for g in range(md.num_row_groups):
            size += md.row_group(g).total_byte_size
            rows += md.row_group(g).num_rows
            if size >= partition_bytes or g == md.num_row_groups - 1:
                parts.append(Partition(len(parts), str(f), kind, g0, g + 1, row0))
                g0, size, row0 = g + 1, 0, rows
        if md.num_row_groups == 0:
            parts.append(Partition(len(parts), str(f), kind, 0, 0, 0))
    elif kind == "arrow":
        state = json.loads((f / "state.json").read_text())
        for df in state.get("_data_files", []):
            parts.append(Partition(len(parts), str(f / df["filename"]), kind, 0, -1, 0))
    else:  # json, and compressed JSONL: a stream has no byte offsets to split at
        parts.append(Partition(len(parts), str(f), kind, 0, -1, 1))


def _jsonl_ranges(f: Path, partition_bytes: int, hasher=None):
    """Byte ranges starting at line starts, with the line number of each start. Reads the file once
    (every byte in order, fed to `hasher` if given)."""
    size = f.stat().st_size
    start, line = 0, 1
    with open_regular(f, "rb", "input") as fh:
        while start < size:
            target = start + partition_bytes
            if target >= size:
                if hasher is not None:
                    fh.seek(start)
                    _count_newlines(fh, size - start, hasher)
                yield start, size, line
                return
            fh.seek(target)
            skip_line(fh)  # move to the next line start (a long line is never read whole)
            end = fh.tell()
            fh.seek(start)
            line_count = _count_newlines(fh, end - start, hasher)
            yield start, end, line
            start, line = end, line + line_count


def _count_newlines(fh, n: int, hasher=None) -> int:
    count = 0
    while n > 0:
        block = fh.read(min(n, 1 << 24))
        if not block:
            break
        if hasher is not None:
            hasher.update(block)
        count += block.count(b"\n")
        n -= len(block)
    return count


Item = tuple[Union[dict, RecordError], str]


def read_partition(p: Partition, batch_size: int, keep=None,
                   max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[list[Item]]:
    if p.kind.startswith("jsonl"):
        items = (_read_jsonl if p.kind == "jsonl" else _read_jsonl_stream)(p, keep, max_record_bytes)
    else:
        items = _read_json(p, max_record_bytes) if p.kind == "json" else \
            {"parquet": _read_parquet, "arrow": _read_arrow}[p.kind](p)
        if keep is not None:
            items = (it for it in items if keep(position(it[1])))
    batch: list[Item] = []
    while True:
        try:  # only the reader's own failures: the consumer's run outside this generator
            item = next(items, None)
        except InputError:
            raise
        except Exception as e:  # a corrupt page or a file that changed under us: name the file
            raise _unreadable(p.file, e) from e
        if item is None:
            break
        batch.append(item)
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _read_jsonl(p: Partition, keep, max_bytes: int) -> Iterator[Item]:
    with open(p.file, "rb") as fh:
        fh.seek(p.start)
        yield from records(bounded_lines(fh, max_bytes, p.end - p.start), p.first_where, keep, max_bytes)


def _read_jsonl_stream(p: Partition, keep, max_bytes: int) -> Iterator[Item]:
    """Compressed JSONL, decompressed as a stream (never whole in memory), numbered like JSONL."""
    with open_stream(p.file, p.kind) as fh:
        yield from records(bounded_lines(fh, max_bytes), p.first_where, keep, max_bytes)


def _read_json(p: Partition, max_bytes: int) -> Iterator[Item]:
    raw = Path(p.file).read_bytes()
    try:
        data = json.loads(raw.decode("utf-8-sig"))  # -sig: a byte order mark is not content
    except UnicodeDecodeError as e:
        yield RecordError("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the file"), "1"
        return
    except RecursionError:
        yield RecordError("too_deep", TOO_DEEP), "1"
        return
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # JSON Lines in a .json file (datasets' json loader reads both): one record per line,
            # not the whole file counted as a single invalid record
            for n, line in enumerate(raw.split(b"\n"), 1):
                if len(line) > max_bytes:
                    yield too_long(LongLine(len(line) + 1), max_bytes), str(n)
                elif line.strip():
                    yield parse_json_line(line, str(n)), str(n)
            return
        yield RecordError("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})"), str(e.lineno)
        return
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        yield RecordError("not_an_object", f"a JSON input must be an object or a list of objects, got "
                                           f"{type(data).__name__}"), "1"
        return
    for i, rec in enumerate(data):
        where = f"record {i}"
        if not isinstance(rec, dict):
            yield RecordError("not_an_object", f"a record must be a JSON object, got {type(rec).__name__}"), where
        else:
            yield rec, where


def _read_parquet(p: Partition) -> Iterator[Item]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(p.file)
    row = p.first_where
    if p.end <= p.start:
        return
    for batch in pf.iter_batches(row_groups=list(range(p.start, p.end)), batch_size=1024):
        for rec in batch.to_pylist():
            yield rec, f"row {row}"
            row += 1


def _read_arrow(p: Partition) -> Iterator[Item]:
    import pyarrow as pa

    row = 0
    with pa.memory_map(p.file) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        for batch in batches:
            for rec in batch.to_pylist():
                yield rec, f"row {row}"
                row += 1


def file_fingerprint(path: str) -> str:
    """Content hash of an input file (sha256), for the manifest fingerprint."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
