"""A held-out split made by reading, never by copying: which records a preprocess run keeps.

A recipe's preprocess stage with `holdout: S` runs twice over the same input files, once per
side (train, val); the reader skips the other side's records (astrai.data.read.read_partition's
`keep`), so every record, and every reject, is located in the user's own file and line.

Which side: every input position has an ordinal, counted from 0 over the input files in order
(files as the inputs expand, Arrow files of a saved dataset in its order): a JSONL line (blank
lines take their place, they are simply not records), a Parquet or Arrow row, an element of a
JSON list. Ordinal i is held out when floor((i + 1) * S) > floor(i * S): evenly spread (S = 0.1:
ordinals 9, 19, 29, ...), the same for any number of workers, partitions or reruns. A file's
ordinals start after those of the files before it, so many small files are split like one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Literal

from astrai.data.streams import open_stream

SIDES = ("train", "val")


def is_held_out(i: int, share: float) -> bool:
    return share > 0 and math.floor((i + 1) * share) > math.floor(i * share)


@dataclass(frozen=True)
class Holdout:
    """Keep one side of the split. `offsets`: the first ordinal of each file (`with_offsets`)."""

    share: float
    side: Literal["train", "val"]
    offsets: dict = field(default_factory=dict, compare=False)

    def keep(self, file: str) -> Callable[[int], bool]:
        """For one file: position in the file (0-based) -> does this side keep the record there."""
        base, share, val = self.offsets[file], self.share, self.side == "val"
        return lambda pos: is_held_out(base + pos, share) == val

    def with_offsets(self, parts) -> "Holdout":
        """The first ordinal of each partition's file, counted over the files in partition order."""
        offsets, n = {}, 0
        files = list(dict.fromkeys(p.file for p in parts))
        kinds = {p.file: p.kind for p in parts}
        for i, f in enumerate(files):
            offsets[f] = n
            if i < len(files) - 1:  # the last file's length moves no one
                n += positions(f, kinds[f])
        return Holdout(self.share, self.side, offsets)

    def describe(self) -> dict:
        return {"share": self.share, "side": self.side}


def position(where: str) -> int:
    """A record's 0-based position from where the reader located it: "row N", "record N", line "N"."""
    return int(where.split()[-1]) if " " in where else int(where) - 1


def positions(file: str, kind: str) -> int:
    """How many ordinals a file takes: one past the last position a record of it can have."""
    if kind == "jsonl":
        with open(file, "rb") as fh:
            return _lines(iter(lambda: fh.read(1 << 24), b""))
    if kind in ("jsonl.gz", "jsonl.zst"):
        with open_stream(file, kind) as fh:
            return _lines(iter(lambda: fh.read(1 << 24), b""))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    if kind == "arrow":
        return _arrow_rows(file)
    return _json_positions(file)


def _lines(blocks) -> int:
    n, last = 0, b"\n"
    for block in blocks:
        n += block.count(b"\n")
        last = block[-1:]
    return n + (last != b"\n")  # a last line without its newline is a line


def _arrow_rows(file: str) -> int:
    import pyarrow as pa

    with pa.memory_map(file) as source:  # batches are mapped, not decoded
        try:
            return sum(b.num_rows for b in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def _json_positions(file: str) -> int:
    """A JSON list: its elements; JSON Lines in a .json file: its lines; anything else: one."""
    from pathlib import Path

    raw = Path(file).read_bytes()
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except json.JSONDecodeError as e:
        return raw.count(b"\n") + 1 if e.msg == "Extra data" else 1
    except (UnicodeDecodeError, RecursionError):
        return 1
    return len(data) if isinstance(data, list) else 1
