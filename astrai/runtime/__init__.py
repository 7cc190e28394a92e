"""Runtime plumbing every stage reuses: a process pool, files (links refused, atomic writes, completion
markers, output directories: astrai.runtime.files), progress.

Stages (preprocess today; train and generate next) describe their work as picklable task
objects and a function `fn(context, task)`; this module runs them, in-process or on a pool of
worker processes, and knows nothing about what they do (as datatrove keeps its executor apart
from its steps).

- `run_tasks`: the per-process context (a tokenizer, a processor, a model) is built once by the
  pool initializer, not cached in a module global by the tasks themselves. With fork, workers
  inherit the context the parent already built (no second load, nothing pickled); with spawn,
  each worker builds it from the picklable `setup`. A worker killed from outside (the OOM
  killer) fails the run with a message instead of hanging it, and the first error stops it.
- files (astrai.runtime.files, imported here): `open_nofollow` (nothing is written through a
  link planted in an output), atomic writes, completion markers, output directories (ownership
  marker, one-writer lock), input identity.
- `Progress`: a tqdm bar on a terminal, a plain line every few seconds otherwise.
- workers exit when their parent dies (they poll getppid), instead of hanging.
- `fewer_collections`: the cyclic garbage collector held off while a step makes millions of containers.

NOTE: this package imports nothing from astrai outside itself: every layer may use it.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Optional, Sequence, TextIO

from astrai.runtime.files import (CHUNK, OUTPUT_MARKER, LinkRefused, OutputBusy, atomic_write_bytes,  # noqa: F401
                                  atomic_write_text, claim_output, file_identity, file_sha256, flock_holder,
                                  fresh_tmp, fsync_dir, fsync_replace, inside_output, is_done, is_ours, mark_done,
                                  marker_info, open_fd_nofollow, open_nofollow, output_lock, read_marker,
                                  refuse_link, remove_stale_tmp, tmp_name)

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


class StageFailed(RuntimeError):
    """The work stopped for a reason outside the task (a worker killed by the OOM killer); what
    finished is kept. The CLI prints it as one line, like a user error."""


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
