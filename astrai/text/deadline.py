"""A deadline for template renders: one watchdog thread per process stops a render that runs too long.

A chat template is code from a checkpoint: `{% for i in range(100000) %}{% for j in range(100000) %}`
allocates nothing and never ends. Python cannot kill a thread, but it can raise an exception in
one (PyThreadState_SetAsyncExc): the render registers its thread and deadline here, and the watchdog
raises Stop in it once the deadline has passed. Stop is a BaseException, so no `except Exception`
inside jinja2 or a template helper swallows it; astrai.text.sandbox turns it into a TemplateLimit.
The limit is DEFAULT_RENDER_SECONDS (5 s); ASTRAI_TEMPLATE_TIMEOUT_S changes it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

TIMEOUT_ENV = "ASTRAI_TEMPLATE_TIMEOUT_S"
DEFAULT_RENDER_SECONDS = 5.0


class Stop(BaseException):
    """Raised by the watchdog inside a render past its deadline. A BaseException, so no `except
    Exception` inside jinja2 or a template helper swallows it."""


def render_seconds() -> float:
    try:
        return max(float(os.environ.get(TIMEOUT_ENV, DEFAULT_RENDER_SECONDS)), 0.001)
    except ValueError:
        return DEFAULT_RENDER_SECONDS


class _Watchdog:
    """Stops renders past their deadline. One daemon thread per process (started on first use,
    again in a forked child, where threads do not survive) looks every POLL_S at the renders in
    progress and raises Stop in a rendering thread whose deadline has passed. A render only
    registers and unregisters (an uncontended lock): nothing wakes the thread per render."""

    POLL_S = 0.1

    def __init__(self):
        self.lock = threading.Lock()
        self.active: dict[int, list] = {}  # thread id -> [deadline, fired]
        self.pid = None

    def _ensure(self):
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.lock = threading.Lock()
            self.active = {}
            threading.Thread(target=self._loop, name="astrai-template-watchdog", daemon=True).start()

    def _loop(self):
        while True:
            time.sleep(self.POLL_S)
            now = time.monotonic()
            with self.lock:
                for tid, entry in self.active.items():
                    if not entry[1] and now >= entry[0]:
                        entry[1] = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(Stop))

    def start(self, seconds: float) -> int:
        self._ensure()
        tid = threading.get_ident()
        with self.lock:
            self.active[tid] = [time.monotonic() + seconds, False]
        return tid

    def stop(self, tid: int) -> bool:
        """Unregister; True when the deadline passed (the caller reports it). A stop that the watchdog
        raised after the render had finished is cancelled here, so it cannot surface elsewhere."""
        with self.lock:
            entry = self.active.pop(tid, None)
            fired = bool(entry and entry[1])
            if fired:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
        return fired


WATCHDOG = _Watchdog()
