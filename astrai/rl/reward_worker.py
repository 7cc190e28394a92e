"""Reward functions in a worker process, so that a call that never returns can be given up on.

A Python call cannot be stopped from outside the thread that runs it (a loop in C, a regular
expression backtracking, a blocked socket), but a process can. `RewardWorker(specs, timeout)`
starts `python -m astrai.rl.reward_worker`, which loads the configured functions
(astrai.rl.rewards.Functions) and answers a batch of calls one result at a time over a pipe
(pickled messages, multiprocessing.connection's framing). The trainer waits at most `timeout`
seconds for each result; past it that call fails ("timed out after 30 s"), the worker is killed
(SIGKILL: a call stuck in C ignores anything milder) and a new one takes the remaining calls. A
worker that dies fails the call it was running the same way. Functions keep their module state
between calls of a run, except across such a restart.

The worker ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: the trainer
decides what it means), ends with the process that started it (PR_SET_PDEATHSIG on Linux, and
at the pipe's end everywhere), and a function's prints go to the run's stdout and stderr as they
would in-process. It is started with subprocess rather than multiprocessing: spawn would run
the caller's __main__ again (a script without a `__main__` guard would start a second training),
and fork would copy a process holding torch's thread pools.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from typing import Iterator, Optional

from astrai.errors import InputError

START_SECONDS = 120  # loading the functions (imports) is not a call: it gets its own, wider limit
ENDED = ("ended",)  # what _recv gives when the worker is gone


class RewardWorker:
    def __init__(self, specs: list, timeout: float):
        self.specs, self.timeout = specs, timeout
        self.proc: Optional[subprocess.Popen] = None
        self.rx = self.tx = None
        self._batch = 0
        self._start()

    def _start(self):
        child_rx, parent_tx = os.pipe()
        parent_rx, child_tx = os.pipe()
        paths = [p or os.getcwd() for p in sys.path]  # the same modules and user files as this process
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "astrai.rl.reward_worker", str(child_rx),
                                          str(child_tx), str(os.getpid())], pass_fds=(child_rx, child_tx), env=env,
                                         stdin=subprocess.DEVNULL)
        finally:
            os.close(child_rx)
            os.close(child_tx)
        self.rx, self.tx = Connection(parent_rx, writable=False), Connection(parent_tx, readable=False)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.rx, self.tx)
        self.tx.send(self.specs)
        msg = self._recv(max(START_SECONDS, self.timeout))
        if msg is not None and msg[0] == "ready":
            return
        self._kill()
        if msg is not None and msg[0] == "error":  # a function that cannot be loaded: its own message
            raise InputError(msg[1])
        why = "it ended; what it printed is above" if msg is ENDED else \
            f"no answer in {max(START_SECONDS, self.timeout):g} s"
        raise InputError(f"reward functions: the worker process that runs them did not start (python -m "
                         f"astrai.rl.reward_worker: {why})")

    def _recv(self, seconds: float):
        """The next message; None when none came in time, ENDED when the worker closed its pipe."""
        try:
            if not self.rx.poll(seconds):
                return None
            return self.rx.recv()
        except (EOFError, OSError):
            return ENDED

    def results(self, items: list[tuple[str, dict]], n_functions: int
                ) -> Iterator[tuple[int, int, Optional[float], Optional[str]]]:
        """(completion k, function j, value, error) for every call, in order."""
        self._batch += 1
        todo = [(k, j) for k in range(len(items)) for j in range(n_functions)]
        i = 0
        try:
            while i < len(todo):
                if self.proc is None:
                    self._start()
                try:
                    self.tx.send((self._batch, items, todo[i:]))
                except OSError:
                    pass  # the worker ended: the next result is missing, and _lost says why
                while i < len(todo):
                    k, j = todo[i]
                    msg = self._recv(self.timeout)
                    if msg is not None and msg is not ENDED and msg[0] != self._batch:
                        continue  # a result of a batch given up on
                    i += 1
                    if msg is None or msg is ENDED:
                        yield k, j, None, self._lost(j, ended=msg is ENDED)
                        break
                    yield msg[1:]
        except BaseException:
            self._kill()  # stopped mid-batch (an error, a signal): the worker would go on with stale calls
            raise

    def _lost(self, j: int, ended: bool) -> str:
        key = self.specs[j].key
        if ended:
            try:
                status = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = "unknown: it closed its pipe"
            self._kill()
            return f"{key}: the reward worker process ended (exit status {status}) during the call"
        self._kill()
        return f"{key}: timed out after {self.timeout:g} s (reward_timeout)"

    def _kill(self):
        if self.proc is not None:
            self._finalizer()
            self.proc = None

    def close(self):
        if self.proc is not None:
            try:
                self.tx.send(None)
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass  # _kill below ends it either way
            self._kill()


def _stop(proc: subprocess.Popen, *conns: Connection):
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for c in conns:
        c.close()


def _die_with_parent(parent: int):
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # no prctl: the worker still ends at the pipe's end, after its current call
    if os.getppid() != parent:  # the parent ended before prctl took effect
        os._exit(0)


def main(argv: list[str]) -> int:
    from astrai.rl.rewards import Functions

    rx, tx = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(int(argv[2]))
    try:
        fns = Functions(rx.recv())
    except InputError as e:
        tx.send(("error", str(e)))
        return 1
    tx.send(("ready",))
    while True:
        try:
            msg = rx.recv()
        except EOFError:
            return 0
        if msg is None:
            return 0
        batch, items, calls = msg
        for k, j in calls:
            tx.send((batch, k, j, *fns.call(j, *items[k])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
