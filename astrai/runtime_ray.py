"""The Ray executor: a stage's independent tasks (one per input partition, one per shard) as Ray tasks.

It plugs in where the local process pool runs the same task functions with the same arguments,
so what the tasks write (files under deterministic names, each under a temporary name renamed
when complete, a completion marker last) is byte-identical to the local run. Nothing else moves
to the cluster: the driver plans partitions, plans the global bins from the lengths and writes
stats and the manifest. See docs/ray.md.

Guarantees:
- Ray is imported only here, lazily; without it, asking for this executor raises a ClusterError
  that names the extra to install (`astrai[ray]`).
- Connecting is bounded: an address where nothing listens is refused at once (one TCP connection
  first), and a cluster that does not answer within ASTRAI_RAY_CONNECT_TIMEOUT_S (default 30 s) is
  a ClusterError naming the address, instead of ray.init's minutes of retries.
- Every node must see the paths the tasks touch (a shared filesystem mounted at the same path):
  `check_nodes` runs one tiny task pinned to each alive node before any work, and reports the
  first node that cannot see an input, the tokenizer or the output directory, by address and
  path. The output check reads back a probe file the driver wrote, so a same-named directory
  local to a node does not pass.
- Tasks run with the driver's working directory, so relative paths mean the same thing there.
- A task whose worker process dies (lost node, OOM killer) is retried by Ray, up to
  MAX_RETRIES times: tasks are idempotent (temporary name, rename). An exception raised by the
  task (a bad record under `on_error: raise`) is not retried, since it would fail again; the first
  one stops the run and is re-raised as itself, e.g. the RecordError with its file:line.
- `ASTRAI_FAULT_DIR` (tests only): a task whose name is a file in that directory removes the file
  and kills its own process, as a crash would, so it fails exactly once (the removal is atomic).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

MAX_RETRIES = 3
EXTRA = "astrai[ray]"


class ClusterError(Exception):
    """Ray is missing, or a node cannot see what the tasks need: stops the run before any work
    (the CLI prints it as `error: ...`, like an InputError). NOTE: like astrai.runtime, this module
    imports nothing from astrai, so every layer may use it."""


def import_ray():
    # Ray's core logs every failed connection attempt as a warning line of its own (read when ray is
    # imported): the run's own error says it once
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
    try:
        import ray
    except ImportError:
        raise ClusterError(f"--executor ray needs Ray, which is not installed: pip install '{EXTRA}' "
                         f"(or use the default --executor local)") from None
    return ray


class RayExecutor:
    """Connected to a cluster (the given address, else RAY_ADDRESS, else a private local instance)
    for one run; a connection made by someone else (ray.init before the run) is reused and kept."""

    def __init__(self, address: Optional[str] = None, log: Callable[[str], None] = print):
        ray = self.ray = import_ray()
        self.log = log
        self.owned = not ray.is_initialized()
        if self.owned:
            # quiet: the run reports its own progress, task errors come back as exceptions. A private
            # instance (no address anywhere) gets no dashboard; a cluster refuses start-up options.
            private = address is None and not os.environ.get("RAY_ADDRESS")
            _connect(ray, address or os.environ.get("RAY_ADDRESS"), logging_level="ERROR", log_to_driver=False,
                     **({"include_dashboard": False} if private else {}))
        self.cwd = os.getcwd()
        self._task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(_run_task)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        cpus = int(sum(n["Resources"].get("CPU", 0) for n in nodes))
        log(f"ray: {len(nodes)} node(s), {cpus} CPU(s)")

    def close(self):
        if self.owned and self.ray.is_initialized():
            self.ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -----------------------------------------------------------------------------------------

    def run_tasks(self, fn: Callable[[Any, Any], Any], tasks: Sequence, *, setup: Callable[[], Any],
                  what: str = "tasks", log: Callable[[str], None] = print, workers: Optional[int] = None,
                  context: Any = None) -> None:
        """astrai.runtime.run_tasks on the cluster: `fn(context, task)` for every task, one Ray task
        each, as many at a time as the cluster has CPUs; returns when all are done, raises the first
        failure. Each Ray worker process builds the context once with `setup()` and keeps it for the
        later tasks of the same setup (the partition tasks and then the shard tasks of a run).
        `workers` and `context` belong to the local pool (a built context cannot travel) and are
        ignored. A task's `name` attribute, if any, labels it (Ray's tooling, ASTRAI_FAULT_DIR)."""
        if not tasks:
            return
        ray = self.ray
        from ray import cloudpickle

        # the same setup (pass 1 and pass 2 of a run) pickles to the same bytes: one context per process
        setup_key = hashlib.sha256(cloudpickle.dumps(setup)).hexdigest()
        setup_ref = ray.put(setup)  # once in the object store, not once per task
        pending = []
        for i, t in enumerate(tasks):
            name = str(getattr(t, "name", f"{what}-{i}"))
            pending.append(self._task.options(name=name).remote(fn, setup_key, setup_ref, t, self.cwd, name))
        try:
            while pending:
                # everything finished within the poll, not one ref per call: thousands of partitions
                # would make one-at-a-time waiting quadratic. A failure still stops the run within a poll.
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2, fetch_local=False)
                for ref in done:
                    ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            self._cancel(pending)
            cause = e.cause
            if cause is not None and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None  # the task's own error (RecordError, InputError, ...), as the local pool
            raise
        except ray.exceptions.RayError as e:  # the worker died more than MAX_RETRIES times, a node was lost...
            self._cancel(pending)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ClusterError(f"a Ray task failed while processing {what} ({type(e).__name__}: {first}); "
                               f"finished {what} are kept: rerun to resume") from None
        except BaseException:
            self._cancel(pending)
            raise
        log(f"{len(tasks)} {what} done as Ray tasks")

    def _cancel(self, refs):
        for r in refs:
            try:
                self.ray.cancel(r)
            except Exception as e:  # an already finished task cannot be cancelled: nothing to do
                self.log(f"ray: could not cancel a task ({e})")

    # -----------------------------------------------------------------------------------------

    def check_nodes(self, needed: list[tuple[str, str]], out: Path):
        """Fail before any work if a node cannot see a needed path or the output directory.

        needed: (what, path) pairs, e.g. ("input", "data/chats.jsonl"), ("tokenizer", "/models/tok")."""
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        out = Path(out)
        token = secrets.token_hex(8)
        probe = out / f".ray-probe-{token}"
        probe.write_text(token)
        try:
            # num_cpus=0: the check must not queue behind busy CPUs; one task pinned to each node
            check = ray.remote(num_cpus=0, max_retries=MAX_RETRIES)(_node_problem)
            nodes = [n for n in ray.nodes() if n["Alive"]]
            refs = [check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(needed, str(out), probe.name, token, self.cwd) for n in nodes]
            for n, problem in zip(nodes, ray.get(refs)):
                if problem:
                    raise ClusterError(f"ray node {n['NodeManagerAddress']} ({n['NodeID'][:12]}) {problem}: inputs, "
                                     f"tokenizer and output must be on storage every node mounts at the same path "
                                     f"(docs/ray.md)")
        finally:
            probe.unlink(missing_ok=True)


CONNECT_TIMEOUT_ENV = "ASTRAI_RAY_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT_S = 30.0


def connect_timeout() -> float:
    try:
        return max(float(os.environ.get(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S)), 0.1)
    except ValueError:
        return DEFAULT_CONNECT_TIMEOUT_S


def _connect(ray, address: Optional[str], **kwargs) -> None:
    """ray.init within connect_timeout() seconds, or a ClusterError saying what to check.

    ray.init retries an address where no cluster answers for minutes. A plain HOST:PORT is first
    tried with one TCP connection (refused or unreachable: said at once); then ray.init runs in a
    daemon thread that the run stops waiting for at the deadline (Ray offers no timeout of its own)."""
    timeout = connect_timeout()
    hint = (f"is the cluster running and is this its address (`ray status` on its head node)? {CONNECT_TIMEOUT_ENV} "
            f"sets how long to wait")
    if address and address != "auto" and "://" not in address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ClusterError(f"--ray-address {address}: expected HOST:PORT (the head node's GCS address, e.g. "
                               f"10.0.0.1:6379), ray://HOST:PORT or auto")
        import socket

        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as e:
            why = "timed out" if isinstance(e, TimeoutError) or isinstance(e, socket.timeout) else (e.strerror or str(e))
            raise ClusterError(f"cannot reach the Ray cluster at {address} ({why}); {hint}") from None
    import threading

    outcome: dict = {}

    def init():
        try:
            ray.init(address=address, **kwargs)
            outcome["ok"] = True
        except BaseException as e:  # handed to the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=init, name="astrai-ray-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" in outcome:
        e = outcome["error"]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterError(f"cannot connect to the Ray cluster at {address or 'a new local instance'} ({first}); "
                           f"{hint}") from None
    if "ok" not in outcome:
        raise ClusterError(f"no Ray cluster answered at {address or 'a new local instance'} within {timeout:g} s; "
                           f"{hint}")


_context: tuple = (None, None)  # (setup key, context) of this Ray worker process


def _run_task(fn, setup_key: str, setup, task, cwd: str, name: str):
    global _context
    os.chdir(cwd)  # relative input paths mean what they mean on the driver (checked by check_nodes)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per task: Ray runs one per CPU
    _fault_point(name)
    if _context[0] != setup_key:
        _context = (setup_key, setup())
    return fn(_context[1], task)


def _fault_point(name: str):
    fault_dir = os.environ.get("ASTRAI_FAULT_DIR")
    if not fault_dir:
        return
    try:
        os.unlink(os.path.join(fault_dir, name))
    except FileNotFoundError:
        return
    os._exit(17)  # die as a crashed worker does: no exception, no cleanup


def _node_problem(needed: list[tuple[str, str]], out: str, probe: str, token: str, cwd: str) -> Optional[str]:
    """What this node cannot see, in words (None when it sees everything)."""
    relative = [p for _, p in needed + [("output", out)] if not os.path.isabs(p)]
    if relative:
        if not os.path.isdir(cwd):
            return f"cannot see the working directory {cwd} (relative paths such as {relative[0]} are taken from it)"
        os.chdir(cwd)
    for what, p in needed:
        if not os.path.exists(p):
            return f"cannot see {what} {p} (no such file or directory)"
        if not os.access(p, os.R_OK):
            return f"cannot read {what} {p} (permission denied)"
    try:
        seen = Path(out, probe).read_text()
    except OSError:
        seen = None
    if seen != token:
        return f"does not see the output directory {out} that the driver writes (a probe file written there is missing)"
    mine = Path(out, f"{probe}-{os.getpid()}")
    try:
        mine.write_text(token)
        mine.unlink()
    except OSError as e:
        return f"cannot write to the output directory {out} ({e.strerror})"
    return None
