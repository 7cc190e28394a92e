"""JSON Lines records, each line read with a bound: a line longer than the bound is passed over, never held.

`bounded_lines(fh, max_bytes, length)` yields each line of a binary file or stream (plain, or a
gzip / zstd stream) with its newline, while its content (the bytes before the newline) is at most
`max_bytes`; a longer line comes back as LongLine(size) instead, after it was read past in
SKIP_CHUNK pieces (`length`: stop after that many bytes, a partition's end). So memory stays
within max_bytes + SKIP_CHUNK whatever the input holds (a 2 GB line included), and the line
numbers after a long line stay right. `skip_line(fh)` moves to the next line start the same way
(partition planning seeks into the middle of a line). `records` parses the lines into records
(`parse_json_line`), a long line becoming a record_too_large RecordError, located by its line
number like any other bad record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional, Union

from astrai.errors import RecordError

SKIP_CHUNK = 1 << 20
TOO_DEEP = "JSON nested too deeply to parse (over Python's recursion limit)"


@dataclass(frozen=True)
class LongLine:
    size: int  # bytes of the line, its newline included


def skip_line(fh: BinaryIO) -> int:
    """Read past the rest of the current line (its newline included); the bytes read."""
    n = 0
    while True:
        piece = fh.readline(SKIP_CHUNK)
        n += len(piece)
        if not piece or piece.endswith(b"\n"):
            return n


def bounded_lines(fh: BinaryIO, max_bytes: int, length: Optional[int] = None) -> Iterator[Union[bytes, LongLine]]:
    left = float("inf") if length is None else length
    while left > 0:
        line = fh.readline(int(min(max_bytes + 1, left)))
        if not line:
            return
        if len(line) <= max_bytes or line.endswith(b"\n"):
            left -= len(line)
            yield line
        else:  # max_bytes + 1 bytes and no newline yet: the content is longer than the bound
            long = LongLine(len(line) + skip_line(fh))
            left -= long.size
            yield long


def too_long(line: LongLine, max_bytes: int) -> RecordError:
    return RecordError("record_too_large", f"the line holds {line.size:,} bytes, more than "
                                           f"preprocessing.max_record_bytes ({max_bytes:,}); it was passed over unread")


def records(lines, first: int, keep, max_bytes: int) -> Iterator[tuple]:
    """(record or RecordError, line number) of each line that is not blank; `keep(position)` chooses
    which lines are parsed at all (astrai.data.holdout)."""
    for line_no, raw in enumerate(lines, first):
        if isinstance(raw, bytes) and not raw.strip() or (keep is not None and not keep(line_no - 1)):
            continue  # blank lines are not records
        yield (too_long(raw, max_bytes) if isinstance(raw, LongLine) else parse_json_line(raw, str(line_no))), \
            str(line_no)


def parse_json_line(raw: bytes, where: str):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RecordError("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the line")
    if where == "1" and text.startswith("\ufeff"):
        text = text[1:]  # a UTF-8 byte order mark (some editors write one) is not part of the record
    try:  # without its line ending: a line cut short is then reported where it stops, not at "column 1"
        rec = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        return RecordError("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})")
    except RecursionError:
        return RecordError("too_deep", TOO_DEEP)
    if not isinstance(rec, dict):
        return RecordError("not_an_object", f"a record must be a JSON object, got {type(rec).__name__}")
    return rec
