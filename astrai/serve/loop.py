"""EngineLoop: one thread steps the engine for every connection; tokens flow back to each handler.

The engine is synchronous and not thread-safe, so exactly one thread touches it. HTTP handlers (on
the asyncio event loop) talk to that thread through a FIFO of commands: add a request's choices,
cancel them, take a snapshot of the counters. The thread drains the commands, then runs one
`engine.step()` (one forward over every running request: a request that arrives while others decode
joins the next step's batch), and hands the step's tokens back to the event loop in one
wake-up per step at most, where each lands in the queue of its HTTP request (`Stream`).

Guarantees:
- commands are applied in the order they were sent, so a snapshot taken after a cancellation sees
  the cancelled request's pages back in the pool;
- a cancelled request is aborted before the next step: its pages go back to the pool (written full
  pages to the radix cache) and it never decodes again;
- if a step raises (a bug, out of memory), every live request ends with an error event and is
  aborted, and the thread goes on serving new requests: the server does not die with it.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

from astrai.infer.request import FINISHED


@dataclass(slots=True)
class Event:
    """One sampled token of one choice, or the end of that choice."""

    index: int  # the choice within its HTTP request
    token: int
    text: str  # newly visible text (may be empty: half a character, or a held-back stop-string prefix)
    logprob: object = None  # astrai.infer.sampling.TokenLogprob when logprobs were asked
    finish_reason: Optional[str] = None  # "stop" | "length" | "error" on the last event of a choice
    completion: object = None  # astrai.infer.engine.Completion on the last event (or the error message)


class Stream:
    """The engine requests of one HTTP request (its n choices, or n per prompt of a batch), event loop side.

    A streaming handler reads every Event from `queue`; a non-streaming one waits for `done` and reads
    `results` (each choice's Completion, or an error message)."""

    def __init__(self, n: int, streaming: bool, arrival: float, loop: asyncio.AbstractEventLoop):
        self.queue: Optional[asyncio.Queue] = asyncio.Queue() if streaming else None
        self.results: list = [None] * n
        self.done: asyncio.Future = loop.create_future()
        self.reqs: list = [None] * n  # the engine's Request of each choice (set on the engine thread)
        self.open = n  # choices not finished (or cancelled) yet
        self.arrival = arrival
        self.last_token = [0.0] * n  # when each choice's last token was handed over (latency metrics)

    @property
    def finished(self) -> bool:
        return self.open == 0


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, tuple[Stream, int]] = {}  # rid -> (stream, choice); engine thread only
        self._thread = threading.Thread(target=self._run, name="astrai-engine", daemon=True)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.in_flight = 0  # engine requests submitted and not finished (event loop side)
        # Steps' events on their way to the event loop: one wake-up covers every step queued before it is served
        # (each wake-up writes to the loop's self-pipe and contends for the GIL: 10% of the engine thread's
        # samples at 16 clients when done per step)
        self._outbox: collections.deque = collections.deque()
        self._wake_pending = False
        self._last_snapshot: Optional[dict] = None  # set on the engine thread (one reference assignment)

    # ---- event loop side ----
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def submit(self, choices: list[tuple[list[int], object]], end_of_turn: bool, streaming: bool = True,
               arrival: Optional[float] = None, grammar: Optional[str] = None,
               adapter: Optional[str] = None) -> Stream:
        """choices: (prompt ids, SamplingParams) per engine request; end_of_turn: the prompts are conversations;
        grammar: every choice's output held to it (compiled by the handler: astrai.serve.structured);
        adapter: the LoRA adapter they run with (None: the base)."""
        stream = Stream(len(choices), streaming, arrival or time.perf_counter(), self._loop)
        self.in_flight += len(choices)
        self._commands.put(("add", stream, choices, end_of_turn, grammar, adapter))
        return stream

    def cancel(self, stream: Stream) -> None:
        """The client is gone: abort what is still running (a no-op for finished choices)."""
        if stream.finished:
            return
        self.in_flight -= stream.open
        if self.metrics is not None:
            self.metrics.finished("abort", stream.open)
        stream.open = 0
        if not stream.done.done():
            stream.done.set_result(None)
        self._commands.put(("cancel", stream))

    async def snapshot(self, wait: Optional[float] = None) -> dict:
        """The engine's counters, taken on the engine thread between two steps (after a cancellation they see
        its pages back). With `wait`: when the engine is still inside a step after that many seconds (a long
        prefill), the last snapshot taken, marked {"stale": True}, so /health answers at once under any load."""
        fut = self._loop.create_future()
        self._commands.put(("snapshot", fut))
        if wait is None or self._last_snapshot is None:
            return await fut
        try:
            return await asyncio.wait_for(asyncio.shield(fut), wait)
        except asyncio.TimeoutError:
            return {**self._last_snapshot, "stale": True}

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    def _post(self, events: list[tuple[Stream, Event]]) -> None:
        """Engine thread: hand events to the event loop."""
        self._outbox.append(events)
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._wake_pending = False  # before popping: events appended from now on schedule their own wake-up
        while self._outbox:
            self._deliver(self._outbox.popleft())

    def _deliver(self, events: list[tuple[Stream, Event]]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for stream, ev in events:
            if stream.finished:
                continue  # cancelled meanwhile: nobody reads it
            last = stream.last_token[ev.index]
            if m is not None and ev.finish_reason != "error":
                m.token(now - (last or stream.arrival), first=not last)
            stream.last_token[ev.index] = now
            if ev.finish_reason is not None:
                stream.results[ev.index] = ev.completion
                stream.open -= 1
                self.in_flight -= 1
                if m is not None:
                    m.finished(ev.finish_reason, 1, ev.completion if ev.finish_reason != "error" else None)
                if stream.open == 0:
                    stream.done.set_result(None)
            if stream.queue is not None:
                stream.queue.put_nowait(ev)

    # ---- engine thread ----
    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._commands.get(block=not engine.has_work())
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._abort_all(None)
                    return
                self._apply(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not engine.has_work():
                continue
            try:
                out = engine.step()
            except Exception as e:  # keep serving: fail the requests of this step, not the server
                traceback.print_exc(file=sys.stderr)
                self._abort_all(f"the engine failed: {type(e).__name__}: {e}")
                continue
            events = []
            for req, token, text in out:
                stream, i = self._live.get(req.rid, (None, 0))
                if stream is None:
                    continue
                lp = req.logprobs[-1] if req.params.logprobs is not None else None
                ev = Event(i, token, text, lp)
                if req.status == FINISHED:
                    ev.finish_reason = req.finish_reason
                    ev.completion = engine.completion(req, i)
                    del self._live[req.rid]
                events.append((stream, ev))
            if events:
                self._post(events)

    def _apply(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, choices, end_of_turn, grammar, adapter = cmd
            for i, (ids, params) in enumerate(choices):
                try:
                    req = self.engine.add_request(ids, params, end_of_turn=end_of_turn, grammar=grammar,
                                                  adapter=adapter)
                except Exception as e:  # checked by the handler before; this one request fails, not the thread
                    self._post([(stream, Event(i, -1, "", None, "error", f"{type(e).__name__}: {e}"))])
                    continue
                stream.reqs[i] = req
                self._live[req.rid] = (stream, i)
        elif kind == "cancel":
            for req in cmd[1].reqs:
                if req is not None and self._live.pop(req.rid, None) is not None:
                    self.engine.abort(req)
        elif kind == "snapshot":
            snap = self._last_snapshot = self._snapshot()
            fut = cmd[1]
            self._loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(snap))

    def _abort_all(self, error: Optional[str]) -> None:
        events = []
        for rid, (stream, i) in list(self._live.items()):
            req = stream.reqs[i]
            self.engine.abort(req)
            events.append((stream, Event(i, -1, "", None, "error", error or "the server is shutting down")))
        self._live.clear()
        if events and self._loop is not None and not self._loop.is_closed():
            self._post(events)

    def _snapshot(self) -> dict:
        e = self.engine
        sched = e.scheduler
        free, cached, total = e.pool.usage()
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_tokens_total": total,
                "kv_tokens_free": free, "kv_tokens_cached": cached,
                "prefix_cache_queried_tokens": sched.num_admitted_tokens,
                "prefix_cache_hit_tokens": sched.num_cached_tokens, "preemptions": sched.num_preemptions,
                "grammar_failures": e.stats.grammar_failures,
                "steps": e.stats.steps}
