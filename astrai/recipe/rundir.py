"""The run directory: one folder per stage, a summary, and nothing written half-way.

    RUN/summary.json            the last run: every stage's status, time, fingerprint, metrics
    RUN/loss.png                loss curve of the last stage that reported one
    RUN/.lock                   held while `astrai run` works here (one writer at a time)
    RUN/<stage>/stage.json      state: fingerprint, status (running | done | failed | interrupted),
                                output_id, times; written under a temporary name and renamed
    RUN/<stage>/log.txt         the stage's log, appended run after run
    RUN/<stage>/metrics.json    the figures the stage returned
    RUN/<stage>/loss.png        its loss curve, when it reported one
    RUN/<stage>/output/         what the stage produced: a tokenizer dir, shards, a checkpoint, a report

A stage is done exactly when its stage.json says so; its output is only ever removed by the runner
when stage.json proves the runner made it (a stale fingerprint), never otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from astrai.config import STAGE_OUTPUT as OUTPUT

STATE = "stage.json"
LOG = "log.txt"
METRICS = "metrics.json"
SUMMARY = "summary.json"
LOSS_PNG = "loss.png"
LOCK = ".lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (another run holds it, or a folder is not ours)."""


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:  # only a hand-edited file can be half-written: treat as unknown state
        return None


@dataclass(frozen=True)
class StageDir:
    root: Path  # RUN/<stage>

    @property
    def output(self) -> Path:
        return self.root / OUTPUT

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

    def is_current(self, fingerprint: str) -> bool:
        state = self.state()
        return bool(state and state.get("status") == "done" and state.get("fingerprint") == fingerprint
                    and self.output.exists())

    def clear_output(self) -> None:
        """Remove an output the runner made for other options (stage.json is the proof it is ours)."""
        if self.state() is None:
            if self.output.exists() and any(self.output.iterdir()):
                raise RunDirError(f"{self.output} exists but has no {STATE} beside it: it was not made by "
                                   f"astrai run; move it away or choose another run_dir")
            return
        if self.output.exists():
            shutil.rmtree(self.output)
        for f in (self.metrics_file, self.loss_png):
            f.unlink(missing_ok=True)


class RunDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    def stage(self, name: str) -> StageDir:
        return StageDir(self.root / name)

    @property
    def summary_file(self) -> Path:
        return self.root / SUMMARY

    @property
    def loss_png(self) -> Path:
        return self.root / LOSS_PNG

    def lock(self) -> "RunLock":
        return RunLock(self.root / LOCK)


class RunLock:
    """An exclusive lock file holding the owner's pid; a lock whose process is gone is taken over."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and _alive(owner):
                    raise RunDirError(f"{self.path.parent} is in use by another `astrai run` (pid {owner}); "
                                       f"wait for it or use another run_dir") from None
                self.path.unlink(missing_ok=True)  # its process is gone: the lock is stale
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            return self
        raise RunDirError(f"cannot take the lock {self.path}")

    def __exit__(self, *exc):
        if self._owner() == os.getpid():
            self.path.unlink(missing_ok=True)

    def _owner(self) -> Optional[int]:
        try:
            return int(self.path.read_text().strip() or -1)
        except (FileNotFoundError, ValueError):
            return None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
