"""Errors for people: each names the file, the line or record, the key and the reason.

Also the one way astrai opens a file a user names (inputs, templates, tokenizer files, prompt
files): `open_regular` / `read_text_regular` / `read_bytes_regular` open only regular files. A FIFO
or a device given where a file is expected would block the run forever or never end (`/dev/zero`),
and a directory fails with an OS error; each is refused at once with an InputError that names the
path, what it was expected to be and what it is. `os_error_line` is the one line the CLI prints for
an OSError (the file, what went wrong, what to do: "No space left on device" included).

NOTE: imports nothing from astrai: every layer may use it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Optional, Union


class InputError(Exception):
    """A problem with an input path, a tokenizer or a template: stops the run."""


class InvalidRequest(InputError, ValueError):
    """A generation request that cannot be run (a bad prompt or sampling option). `index` is the
    request's position in the call, when the engine knows it (the CLI turns it into file:line)."""

    def __init__(self, message: str, index: Optional[int] = None):
        super().__init__(message)
        self.index = index


class RecordError(Exception):
    """One bad record. `reason` is a short stable code counted in stats.json (e.g. missing_field)."""

    def __init__(self, reason: str, detail: str, file: str = "", line: Optional[str] = None, key: str = ""):
        self.reason = reason
        self.detail = detail
        self.file = file
        self.line = line
        self.key = key
        super().__init__(self._text())

    def __reduce__(self):  # keeps the fields across process boundaries (worker -> main)
        return (RecordError, (self.reason, self.detail, self.file, self.line, self.key))

    def located(self, file: str, line: Optional[str]) -> "RecordError":
        """The same error with its place: file and line ("12") or record ("record 3", "row 7")."""
        return RecordError(self.reason, self.detail, file, line, self.key)

    def at_key(self, key: str) -> "RecordError":
        return RecordError(self.reason, self.detail, self.file, self.line, key)

    def _text(self) -> str:
        where = f"{self.file}:{self.line}: " if self.file else ""
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.detail} [{self.reason}]"

    def as_json(self) -> dict:
        return {"file": self.file, "line": self.line, "key": self.key, "reason": self.reason, "detail": self.detail}


class ModelFileError(InputError, ValueError):
    """A model directory, config.json or weights file that astrai refuses to load (it names the file and
    the key or tensor). A ValueError too, so callers that catch bad values catch it."""


# ---------------------------------------------------------------------------------------------
# regular files only

PathLike = Union[str, os.PathLike]


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: PathLike, what: str, kind: str, error: type = InputError) -> InputError:
    return error(f"{what} {path}: is {kind}, not a regular file; give the path of a file")


def regular_file(path: PathLike, what: str = "file") -> Path:
    """`path` if it names a regular file (after symlinks); else an InputError saying what it is."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise InputError(f"{what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, what, _kind(st.st_mode))
    return Path(path)


def open_regular(path: PathLike, mode: str = "r", what: str = "file", encoding: Optional[str] = "utf-8",
                 error: type = InputError, **kw):
    """open(path, mode) for reading, refusing anything but a regular file before a byte is read, with
    `error` (an InputError class: ModelFileError for a checkpoint's files).

    The file is opened non-blocking (opening a FIFO without a writer would block) and checked on
    the open descriptor (no window between a check and the open)."""
    if any(c in mode for c in "wax+"):
        raise ValueError("open_regular opens files for reading")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise _refuse(path, what, "a directory", error) from None
    except OSError as e:
        raise error(f"{what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, what, _kind(st.st_mode), error)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return open(fd, mode, encoding=None if "b" in mode else encoding, **kw)
    except BaseException:
        os.close(fd)
        raise


def read_bytes_regular(path: PathLike, what: str = "file", max_bytes: Optional[int] = None) -> bytes:
    with open_regular(path, "rb", what) as fh:
        if max_bytes is not None:
            size = os.fstat(fh.fileno()).st_size
            if size > max_bytes:
                raise InputError(f"{what} {path}: {size:,} bytes, more than the {max_bytes:,} such a file may "
                                 f"have; is it the right file?")
        return fh.read()


def read_text_regular(path: PathLike, what: str = "file", max_bytes: Optional[int] = None) -> str:
    data = read_bytes_regular(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


# ---------------------------------------------------------------------------------------------
# OS errors as one line

_WHAT_TO_DO = {
    errno.ENOSPC: "free space there or write to another filesystem; finished work is kept, rerun to continue",
    errno.EDQUOT: "the disk quota is used up: free space or write elsewhere",
    errno.EACCES: "check the permissions, or choose another path",
    errno.EPERM: "check the permissions, or choose another path",
    errno.EROFS: "the filesystem is read-only: choose a writable path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "give a file, not a directory",
    errno.EEXIST: "it is in the way: remove it or choose another path",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
}


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the path(s), the system's words, and what to do."""
    words = e.strerror or str(e) or type(e).__name__
    paths = [str(p) for p in (e.filename, getattr(e, "filename2", None)) if p is not None]
    where = " -> ".join(paths)
    hint = _WHAT_TO_DO.get(e.errno or -1)
    return (f"{where}: " if where else "") + words + (f" ({hint})" if hint else "")


def no_space_left(e: BaseException) -> bool:
    """True for an error that reports a full disk, whatever library raised it (torch, safetensors and
    pyarrow say so in their own types and words), or one raised while handling such an error."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False
