"""Runtime plumbing every stage reuses: a process pool, atomic writes, completion markers, output
directories (ownership marker, one-writer lock), input identity, progress.

Stages (preprocess today; train and generate next) describe their work as picklable task
objects and a function `fn(context, task)`; this module runs them, in-process or on a pool of
worker processes, and knows nothing about what they do (as datatrove keeps its executor apart
from its steps).

- `run_tasks`: the per-process context (a tokenizer, a processor, a model) is built once by the
  pool initializer, not cached in a module global by the tasks themselves. With fork, workers
  inherit the context the parent already built (no second load, nothing pickled); with spawn,
  each worker builds it from the picklable `setup`. A worker killed from outside (the OOM
  killer) fails the run with a message instead of hanging it, and the first error stops it.
- `atomic_write_text` / `atomic_write_bytes`: written under `.NAME.tmp-PID`, fsynced, renamed;
  a reader sees the old file or the whole new one, never half. `remove_stale_tmp` clears what a
  killed run left.
- completion markers: a unit of work is done when its marker exists; the marker is written last
  (atomically) and may carry the unit's summary, so a rerun skips exactly the finished units.
- output directories: `claim_output`/`is_ours` (the OUTPUT_MARKER file astrai writes is the only
  proof a directory is ours), `output_lock` (flock on the directory: one writer, gone with the
  process), `inside_output` (inputs are never read from an output).
- `file_identity`: size/mtime/inode before and after reading, so a changed input is detected.
- `Progress`: a tqdm bar on a terminal, a plain line every few seconds otherwise.
- workers exit when their parent dies (they poll getppid), instead of hanging.
- `fewer_collections`: the cyclic garbage collector held off while a step makes millions of containers.

NOTE: this module imports nothing from astrai: every layer may use it.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

# ---------------------------------------------------------------------------------------------
# atomic files


def tmp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (hidden, unique per process)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True):
    """durable=False skips the fsync: for a file that only saves work (a cache its reader can
    recompute), where a power loss may lose it but a killed process never does."""
    path = Path(path)
    tmp = tmp_name(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str, durable: bool = True):
    atomic_write_bytes(path, text.encode("utf-8"), durable)


def remove_stale_tmp(folder: Path):
    """Temporary files from a killed run (never part of the output)."""
    folder = Path(folder)
    if folder.exists():
        for f in folder.glob(".*.tmp-*"):
            f.unlink(missing_ok=True)


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
# process pool

_context: Any = None  # this worker process's context, set once by the pool initializer


def _exit_with_parent(parent: int, every_s: float = 0.5):
    """A worker whose parent died (SIGKILL, OOM killer) exits at once instead of working through
    its queue and then waiting forever for the next task: its unfinished unit is redone on a rerun."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init_worker(setup: Callable[[], Any], context: Any, parent: int):
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per worker process
    _exit_with_parent(parent)
    global _context
    _context = context if context is not None else setup()


def _call(fn: Callable[[Any, Any], Any], task: Any):
    return fn(_context, task)


def run_tasks(fn: Callable[[Any, Any], Any], tasks: Sequence, *, workers: int, setup: Callable[[], Any],
              context: Any = None, what: str = "tasks", log: Callable[[str], None] = print,
              on_done: Optional[Callable[[Any], None]] = None, in_process: Optional[Callable] = None) -> None:
    """Run `fn(context, task)` for every task; in this process when workers == 1 or there is one
    task, else on `workers` processes. `setup()` builds the context (picklable: a module-level
    function or a functools.partial of one); `context`, when given, is that context already built
    here. Results are not returned: tasks write their own outputs and markers. `on_done(task)` is
    called here, in this process, as each task finishes (progress); `in_process(context, tasks,
    on_done)`, if given, runs them when they run here (a stage that streams them), instead of fn."""
    if not tasks:
        return
    on_done = on_done or (lambda task: None)
    if workers == 1 or len(tasks) == 1:
        ctx = context if context is not None else setup()
        if in_process is not None:
            return in_process(ctx, tasks, on_done)
        for t in tasks:
            fn(ctx, t)
            on_done(t)
        return
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # fork where available: workers start at once, inherit the context, and a caller's script needs
    # no __main__ guard. The parent never encodes, so no tokenizer thread pool is inherited
    # half-initialized. Not multiprocessing.Pool: when a worker is killed from outside, Pool waits
    # forever for its task; this executor fails the run, and a rerun resumes.
    fork = "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork" if fork else "spawn")
    pool = ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx, initializer=_init_worker,
                               initargs=(setup, context if fork else None, os.getpid()))
    try:
        futures = {pool.submit(_call, fn, t): t for t in tasks}
        for f in as_completed(futures):  # the first error stops the run
            if f.exception() is not None:
                raise f.exception()
            on_done(futures[f])
    except BrokenProcessPool:
        raise StageFailed(f"a worker process died while processing {what} (killed from outside, e.g. out of "
                           f"memory); finished {what} are kept: rerun to resume") from None
    except BaseException:
        # stop at the first error: the other workers' unfinished work is redone on a rerun (their
        # temporary files are removed then)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    log(f"{len(tasks)} {what} done with {workers} workers")


# ---------------------------------------------------------------------------------------------
# input identity


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
    (a user's stats.json or .work/ proves nothing). `marker`: another marker's name (a recipe's run
    directory has its own, so inputs may still be read from inside it)."""
    try:
        info = json.loads((Path(folder) / marker).read_text())
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


class StageFailed(RuntimeError):
    """The work stopped for a reason outside the task (a worker killed by the OOM killer); what
    finished is kept. The CLI prints it as one line, like a user error."""


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


# ---------------------------------------------------------------------------------------------
# garbage collection

_gc_lock, _gc_depth, _gc_saved = threading.Lock(), 0, ()


@contextmanager
def fewer_collections(first: int = 50_000):
    """Hold off the cyclic collector (every 700 net container allocations by default, the old
    generations walking every live object) while a step makes millions of containers that die young
    in no cycle (tokenizing 4,000 chats ran it 726 times): objects alive before are frozen out and the
    first threshold raised, both restored after; a disabled collector or a caller's freeze is left
    alone. The settings are process-wide, so overlapping uses (nested, or another thread) share one:
    the first to enter sets it, the last to leave restores it."""
    global _gc_depth, _gc_saved
    with _gc_lock:
        if _gc_depth == 0:
            before, freeze = gc.get_threshold(), gc.get_freeze_count() == 0
            _gc_saved = (before, freeze)
            if freeze:
                gc.freeze()
            if before[0]:
                gc.set_threshold(max(before[0], first), *before[1:])
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0:
                (before, freeze), _gc_saved = _gc_saved, ()
                gc.set_threshold(*before)
                if freeze:
                    gc.unfreeze()


# ---------------------------------------------------------------------------------------------
# progress

PROGRESS_EVERY_S = 5.0  # how often a plain progress line is printed when not on a terminal


class Progress:
    """Progress of a long run, shared by stages: one mechanism, two outputs.

    On a terminal: a tqdm bar (units done of total, rate, ETA) with the stage's counts after it.
    Otherwise (a log file, CI): a plain line every PROGRESS_EVERY_S seconds and at the end, so
    logs stay readable. `counts` are whatever the stage counts (records, tokens); the rate and ETA
    are per unit of `what` (partitions, steps)."""

    def __init__(self, total: int, what: str, stream: Optional[TextIO] = None, clock=None):
        import sys
        import time

        self.total, self.what = total, what
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock or time.monotonic
        self.done = 0
        self.counts: dict[str, int] = {}
        self.start = self.last = self.clock()
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=" " + what, file=self.stream, dynamic_ncols=True, mininterval=0.1)

    def update(self, units: int = 1, **counts: int):
        self.done += units
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + int(v)
        now = self.clock()
        if self.bar is not None:
            self.bar.set_postfix_str(self._counts(now), refresh=False)
            self.bar.update(units)
        elif now - self.last >= PROGRESS_EVERY_S or self.done == self.total:
            self.last = now
            self.stream.write(f"progress: {self.line(now)}\n")
            self.stream.flush()

    def _counts(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        counts = "  ".join(f"{v:,} {k}" for k, v in self.counts.items())
        per_s = "  ".join(f"{v / elapsed:,.0f} {k}/s" for k, v in self.counts.items())
        return f"{counts}  {per_s}".strip()

    def line(self, now: Optional[float] = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else None
        return (f"{self.done}/{self.total} {self.what}  {self._counts(now)}  elapsed {_clock(elapsed)}"
                + (f"  ETA {_clock(eta)}" if eta is not None and self.done < self.total else ""))

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"
