"""Files astrai writes: never through a link, never half, only into directories it owns.

- `open_nofollow`: the one way astrai opens a file inside an output or run directory for writing
  or appending (logs, metrics.jsonl, locks): O_NOFOLLOW on the last component, so a symbolic link
  planted there is refused (LinkRefused, naming it) instead of written through, and only a regular
  file is accepted (a FIFO would block, a device swallow or stream). `refuse_link` does the same for
  a directory astrai is about to write into.
- `atomic_write_text` / `atomic_write_bytes`: written under `.NAME.tmp-PID` (created exclusively,
  never through a link), fsynced, renamed; a reader sees the old file or the whole new one, never
  half. The rename replaces a link at NAME itself, never its target. `fresh_tmp` gives a library
  writer (safetensors, pyarrow, matplotlib) the same temporary file, `fsync_replace` renames it in.
  `remove_stale_tmp` clears what a killed run left.
- completion markers: a unit of work is done when its marker exists; the marker is written last
  (atomically) and may carry the unit's summary, so a rerun skips exactly the finished units.
- output directories: `claim_output`/`is_ours` (the marker file astrai writes is the only proof a
  directory is ours), `output_lock` (flock on the directory: one writer, gone with the process),
  `inside_output` (inputs are never read from an output).
- `file_identity`: size/mtime/inode before and after reading, so a changed input is detected;
  `file_sha256`: a file's digest, read in blocks.

NOTE: imports nothing from astrai: every layer may use it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Optional

# ---------------------------------------------------------------------------------------------
# never through a link


class LinkRefused(OSError):
    """A path astrai was about to write is a symbolic link or not a regular file (directory); the CLI
    prints it as one line naming the path (an OSError: astrai.errors.os_error_line)."""

    def __init__(self, path, what: str = "a symbolic link"):
        super().__init__(errno.ELOOP, f"is {what}; astrai never writes through a link or into a special file "
                                      f"inside its output (remove it, or choose another output)", str(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def refuse_link(path: Path, directory: bool = False) -> Path:
    """`path` when it is absent, or a regular file (`directory`: a directory) that is not a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Path(path)
    if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR if directory else stat.S_ISREG)(st.st_mode):
        raise LinkRefused(path, _kind(st.st_mode))
    return Path(path)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_ACCESS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
           "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}


def open_fd_nofollow(path, flags: int, perms: int = 0o644) -> int:
    """os.open(path, flags | O_NOFOLLOW), refusing a link or anything but a regular file at `path`
    (opened non-blocking, checked on the descriptor, so a FIFO neither blocks nor is written)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), perms)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise LinkRefused(path) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing
            raise LinkRefused(path, "a FIFO (named pipe)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise LinkRefused(path, _kind(mode))
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_nofollow(path, mode: str = "w", encoding: Optional[str] = "utf-8", perms: int = 0o644):
    """open(path, mode) of a regular file, never through a link (modes r, w, a, x, with b and +)."""
    flags = _ACCESS[mode.replace("b", "").replace("+", "")]
    if "+" in mode:
        flags = (flags & ~(os.O_WRONLY | os.O_RDONLY)) | os.O_RDWR
    fd = open_fd_nofollow(path, flags, perms)
    try:
        if mode.startswith("w"):
            os.ftruncate(fd, 0)  # after the checks: a FIFO or a link is never truncated
        return open(fd, mode.replace("x", "w"), encoding=None if "b" in mode else encoding)
    except BaseException:
        os.close(fd)
        raise


# ---------------------------------------------------------------------------------------------
# atomic files


def tmp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (hidden, unique per process)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fresh_tmp(path: Path) -> Path:
    """tmp_name(path), emptied and created anew as a regular file of ours (whatever was planted at
    that name, a link included, is removed, not followed): for a library that writes by file name."""
    tmp = tmp_name(path)
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise LinkRefused(tmp, "a directory") from None
    os.close(open_fd_nofollow(tmp, _ACCESS["x"]))
    return tmp


def fsync_replace(tmp: Path, path: Path, durable: bool = True):
    """Rename the finished `tmp` to `path` (after an fsync); a link at `path` is replaced, not followed."""
    if durable:
        fd = open_fd_nofollow(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True):
    """durable=False skips the fsync: for a file that only saves work (a cache its reader can
    recompute), where a power loss may lose it but a killed process never does."""
    path = Path(path)
    tmp = fresh_tmp(path)
    try:
        with open_nofollow(tmp, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str, durable: bool = True):
    atomic_write_bytes(path, text.encode("utf-8"), durable)


def remove_stale_tmp(folder: Path):
    """Temporary files from a killed run (never part of the output)."""
    folder = Path(folder)
    if folder.exists():
        for f in folder.glob(".*.tmp-*"):
            f.unlink(missing_ok=True)


def fsync_dir(path: Path):
    """Make the renames and removals inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# completion markers


def is_done(marker: Path) -> bool:
    return Path(marker).exists()


def mark_done(marker: Path, summary: dict):
    """Write a unit's completion marker (its summary as JSON). Call it after everything else the
    unit writes is in place: its existence is what a rerun trusts."""
    atomic_write_text(marker, json.dumps(summary, sort_keys=True))


def read_marker(marker: Path) -> dict:
    return json.loads(Path(marker).read_text())


# ---------------------------------------------------------------------------------------------
# input identity

CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def file_identity(paths) -> dict:
    """(size, mtime_ns, inode) of each file (every file under a directory): taken before reading and
    compared after, so an input replaced, truncated or appended while it was read is detected (and a
    later restore of the old bytes cannot make the half-read result look complete)."""
    out = {}
    for p in paths:
        p = Path(p)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                out[str(f)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


# ---------------------------------------------------------------------------------------------
# output directories: ownership marker and one writer at a time

OUTPUT_MARKER = ".astrai-output"  # written by astrai into every output directory it owns


def is_ours(folder: Path, marker: str = OUTPUT_MARKER) -> bool:
    """True when `folder` carries the marker astrai writes: never because of a file named like ours
    (a user's stats.json or .work/ proves nothing), nor a marker that is a link. `marker`: another
    marker's name (a recipe's run directory has its own, so inputs may still be read from inside it;
    a train output its own, so neither stage takes the other's output for its own)."""
    try:
        with open_nofollow(Path(folder) / marker, "r") as fh:
            info = json.loads(fh.read(1 << 16))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("written_by") == "astrai"


def marker_info(folder: Path) -> dict:
    return json.loads((Path(folder) / OUTPUT_MARKER).read_text()) if is_ours(folder) else {}


def claim_output(folder: Path, info: dict, marker: str = OUTPUT_MARKER):
    """Write (or update) the ownership marker; call it only on an empty folder or one `is_ours`."""
    atomic_write_text(Path(folder) / marker, json.dumps({"written_by": "astrai", **info}, sort_keys=True))


def inside_output(path: Path, exclude: Path | None = None) -> bool:
    """True when `path` lies inside (or is) a directory astrai owns (its marker), or the output
    `exclude` of the run asking (not marked yet on a first run): inputs are never read from one."""
    path = Path(path).absolute()
    if exclude is not None:
        ex = Path(exclude).absolute()
        if path == ex or ex in path.parents:
            return True
    return any((p / OUTPUT_MARKER).is_file() for p in (path, *path.parents))


class OutputBusy(RuntimeError):
    pass


def flock_holder(fd: int) -> Optional[int]:
    """The pid holding a flock on the file open as `fd`, from /proc/locks (Linux; None elsewhere or
    when it cannot be told). Lines read `1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF`;
    a blocked waiter's line carries `->` and is skipped."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "->" not in parts and len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == where:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


class output_lock:
    """Exclusive lock on an output directory for a whole run (created if missing).

    flock on the directory itself: nothing is written into a directory before it is known to be
    ours, the lock goes with the process on any exit (a crash leaves no stale lock to clean), and a
    second run into the same directory (another process, or this one) is refused at once, naming
    the holder's pid where the system tells it (flock_holder)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.fd: int | None = None

    def __enter__(self):
        import fcntl

        if self.folder.exists() and not self.folder.is_dir():
            raise NotADirectoryError(f"output {self.folder} is a file, not a directory: give a directory with -o")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = flock_holder(self.fd)
            os.close(self.fd)
            self.fd = None
            raise OutputBusy(f"output {self.folder} is being written by another astrai run"
                             + (f" (pid {holder})" if holder else "")
                             + "; wait for it to finish or choose another output directory") from None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None
        return False
