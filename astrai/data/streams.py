"""Compressed JSONL inputs opened as byte streams, decompressed as they are read (never whole in
memory): `.jsonl.gz` with the standard library, `.jsonl.zst` with the zstandard package (the `zstd`
extra). Shared by the reader (astrai.data.read) and the held-out split, which counts their lines."""

from __future__ import annotations

import io

from astrai.errors import InputError


def open_stream(file: str, kind: str):
    """A binary stream of the decompressed bytes of `file`, of kind "jsonl.gz" or "jsonl.zst"."""
    if kind == "jsonl.gz":
        import gzip

        return gzip.open(file, "rb")
    try:
        import zstandard
    except ImportError:
        raise InputError(f"input {file}: reading .zst needs the zstandard package (pip install zstandard, "
                         f"or astrai[zstd])") from None
    raw = open(file, "rb")
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
