"""Run one benchmark measurement in a fresh child process and collect what it printed and used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Optional


def run_child(cmd: list[str], cwd: str, env: Optional[dict] = None, what: str = "child",
              watch: Optional[Callable[[int], Callable[[], None]]] = None):
    """Run cmd; return (its last stdout line as JSON, its stderr, its own rusage from wait4).

    watch(pid), if given, starts observing the child and returns a function that stops it."""
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, env=env, cwd=cwd)
        stop = watch(proc.pid) if watch else None
        _, status, ru = os.wait4(proc.pid, 0)  # this child's own rusage (and its workers'), reaped here
        if stop:
            stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0), se.seek(0)
        stdout, stderr = so.read(), se.read()
    if proc.returncode != 0:
        sys.stderr.write(stdout + stderr)
        raise SystemExit(f"{what} failed, exit {proc.returncode}")
    return json.loads(stdout.strip().splitlines()[-1]), stderr, ru
