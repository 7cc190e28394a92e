"""The run directory: one folder per stage, a summary, and nothing written half-way.

    RUN/.astrai-run             the marker that makes RUN ours (astrai.runtime.claim_output)
    RUN/summary.json            the last run: every stage's status, time, fingerprint, metrics
    RUN/loss.png                loss curve of the last stage that reported one
    RUN/.lock                   flock'ed while `astrai run` works here (one writer at a time)
    RUN/<stage>/stage.json      state: fingerprint, status (running | done | failed | interrupted),
                                output_id, a stamp of the output, times; a replacement in progress
                                as `pending`; written under a temporary name, fsynced and renamed
    RUN/<stage>/log.txt         the stage's log, appended run after run
    RUN/<stage>/metrics.json    the figures the stage returned
    RUN/<stage>/loss.png        its loss curve, when it reported one
    RUN/<stage>/output/         what the stage produced: a tokenizer dir, shards, a checkpoint, a report
    RUN/<stage>/output.next/    the replacement of a finished output while it is being made

Ownership: RUN is used only when it carries astrai's marker or is empty (then it is claimed); the
filesystem root and home directories never are. A stage's output is only ever removed by the
runner when stage.json proves the runner made it. The lock is an flock on RUN/.lock (the file
itself proves nothing and is never deleted): it goes with its process, and a second run is refused
naming the holder's pid, with no window where a lock file without a pid could be taken as stale.

A finished output is never removed before its replacement is complete: the replacement is made in
`output.next/` and swapped in (`output` moved to `.output.replaced`, `output.next` renamed to
`output`, fsync, then the old one deleted); a run killed during the swap is put back in order by
`recover` on the next run.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from astrai.config import STAGE_OUTPUT as OUTPUT
from astrai.runtime import (LinkRefused, atomic_write_text, claim_output, flock_holder, fsync_dir, is_ours,
                            open_fd_nofollow, open_nofollow, refuse_link)

STATE = "stage.json"
LOG = "log.txt"
METRICS = "metrics.json"
SUMMARY = "summary.json"
LOSS_PNG = "loss.png"
LOCK = ".lock"
RUN_MARKER = ".astrai-run"
NEXT = OUTPUT + ".next"
ASIDE = "." + OUTPUT + ".replaced"
Stamp = tuple[tuple[str, ...], tuple[str, ...]]  # StageKind.stamped, StageKind.unstamped


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (another run holds it, or a folder is not ours)."""


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Optional[dict]:
    """The JSON object in `path`; None when it is absent or not one. A link planted at its name is
    refused (LinkRefused): a state read through it could claim an output for the runner."""
    try:
        with open_nofollow(path, "r") as fh:
            data = json.loads(fh.read())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):  # only a hand-edited file can be half-written
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class StageDir:
    root: Path  # RUN/<stage>

    @property
    def output(self) -> Path:
        return self.root / OUTPUT

    @property
    def next(self) -> Path:
        return self.root / NEXT

    @property
    def log_file(self) -> Path:
        return self.root / LOG

    @property
    def metrics_file(self) -> Path:
        return self.root / METRICS

    @property
    def loss_png(self) -> Path:
        return self.root / LOSS_PNG

    def state(self) -> Optional[dict]:
        return read_json(self.root / STATE)

    def write_state(self, state: dict) -> None:
        write_json(self.root / STATE, state)

    def changed(self, stamp: Stamp = ((), ())) -> Optional[str]:
        """What differs in the output from the stamp recorded when it was made (None: nothing).
        `stamp`: (the parts of the output stamped, file names left out), from the stage's kind."""
        from astrai.recipe.fingerprint import output_changes

        state = self.state() or {}
        if "output_stamp" not in state:
            return "no record of the output (made by an older astrai)"
        return output_changes(self.output, stamp[0], state["output_stamp"], stamp[1])

    def is_current(self, fingerprint: str, stamp: Stamp = ((), ())) -> bool:
        state = self.state()
        return bool(state and state.get("status") == "done" and state.get("fingerprint") == fingerprint
                    and self.output.exists() and self.changed(stamp) is None)

    def clear_output(self) -> None:
        """Remove an output the runner made for other options (stage.json is the proof it is ours)."""
        if self.state() is None:
            for d in (self.output, self.next):
                if d.exists() and any(d.iterdir()):
                    raise RunDirError(f"{d} exists but has no {STATE} beside it: it was not made by "
                                      f"astrai run; move it away or choose another run_dir")
            return
        for d in (self.output, self.next):
            if d.exists():
                shutil.rmtree(d)
        for f in (self.metrics_file, self.loss_png):
            f.unlink(missing_ok=True)

    def clear_next(self) -> None:
        if self.next.exists():
            shutil.rmtree(self.next)

    def swap_in_next(self) -> None:
        """The finished replacement becomes the output; the old output is deleted only after that."""
        aside = self.root / ASIDE
        shutil.rmtree(aside, ignore_errors=True)
        if self.output.exists():
            os.replace(self.output, aside)
        os.replace(self.next, self.output)
        fsync_dir(self.root)

    def drop_replaced(self) -> None:
        shutil.rmtree(self.root / ASIDE, ignore_errors=True)

    def recover(self, stamp: Stamp = ((), ())) -> None:
        """Undo what a kill during `swap_in_next` left: the old output aside and no output (put it
        back), or both (the state written last tells which one it records: keep that one)."""
        aside = self.root / ASIDE
        if not aside.exists():
            return
        if not self.output.exists():
            os.replace(aside, self.output)
        elif self.changed(stamp) is None:  # the state was written: the swap was complete
            shutil.rmtree(aside)
        else:  # the state still records the old output: the new one goes back to output.next
            shutil.rmtree(self.next, ignore_errors=True)
            os.replace(self.output, self.next)
            os.replace(aside, self.output)
        fsync_dir(self.root)


class RunDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    def stage(self, name: str) -> StageDir:
        path = self.root / name
        for p in (path, path / OUTPUT, path / NEXT, path / ASIDE):
            if p.is_symlink():
                raise RunDirError(f"{p} is a link out of the run directory; astrai writes only inside {self.root}")
        if path.exists() and path.resolve().parent != self.root.resolve():
            raise RunDirError(f"{path} is a link out of the run directory; astrai writes only inside {self.root}")
        for f in (STATE, LOG):  # opened in place (not renamed over): a planted link is refused before any write
            refuse_link(path / f)
        return StageDir(path)

    @property
    def summary_file(self) -> Path:
        return self.root / SUMMARY

    @property
    def loss_png(self) -> Path:
        return self.root / LOSS_PNG

    def claim(self, recipe_name: str) -> None:
        """Use RUN only when it is ours (marker) or empty (then mark it); refuse anything else
        before writing a byte into it."""
        root = self.root
        try:
            resolved, home = root.resolve(), Path.home().resolve()
        except (OSError, RuntimeError):
            resolved, home = root.absolute(), None
        if resolved == Path(resolved.anchor) or (home is not None and (resolved == home or resolved in home.parents)):
            raise RunDirError(f"run_dir {root} is the filesystem root or a home directory; give the recipe a run "
                              f"directory of its own (e.g. run_dir: runs/{recipe_name})")
        if root.exists() and not root.is_dir():
            raise RunDirError(f"run_dir {root} is a file; give a directory")
        try:
            if root.exists() and not is_ours(root, RUN_MARKER) and any(root.iterdir()):
                raise RunDirError(f"run_dir {root} holds files astrai did not write (no {RUN_MARKER} marker); nothing "
                                  f"in it was touched: choose a new or empty run_dir (a run directory of an older "
                                  f"astrai: delete it)")
            root.mkdir(parents=True, exist_ok=True)
            if not is_ours(root, RUN_MARKER):
                claim_output(root, {"kind": "recipe run", "recipe": recipe_name}, RUN_MARKER)
        except OSError as e:
            raise RunDirError(f"run_dir {root}: {e.strerror or e}; choose a run_dir you can write") from None

    def lock(self) -> "RunLock":
        return RunLock(self.root / LOCK)


class RunLock:
    """flock on RUN/.lock for a whole run; the file carries the holder's pid for people, the kernel's
    lock table says who holds it (astrai.runtime.flock_holder)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: Optional[int] = None

    def __enter__(self):
        import fcntl

        try:  # never through a link planted at RUN/.lock (it would get our pid)
            fd = open_fd_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        except LinkRefused:
            raise
        except OSError as e:
            raise RunDirError(f"cannot create the lock {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = flock_holder(fd)
            os.close(fd)
            raise RunDirError(f"{self.path.parent} is in use by another `astrai run`"
                              + (f" (pid {holder})" if holder else "") + "; wait for it or use another run_dir") \
                from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the flock; the file stays (deleting it would race a waiting run)
            self.fd = None
        return False
