"""EngineLoop.snapshot: exact between two engine steps; while one step runs long, /health's snapshot answers at
once with the last figures, marked stale (an engine that only pretends to step, so a step lasts as long as wanted)."""

import asyncio
import threading
import time
from types import SimpleNamespace

from astrai.serve.loop import EngineLoop


class SlowEngine:
    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_admitted_tokens=0, num_cached_tokens=0,
                                         num_preemptions=0)
        self.pool = SimpleNamespace(usage=lambda: (100, 0, 100))
        self.stats = SimpleNamespace(steps=0, grammar_failures=0)
        self.work = threading.Event()

    def has_work(self):
        return self.work.is_set()

    def step(self):
        time.sleep(1.5)  # one long prefill
        self.work.clear()
        self.stats.steps += 1
        self.scheduler.running = []
        return []


def test_a_long_step_gives_the_last_snapshot_marked_stale():
    engine = SlowEngine()

    async def main():
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        first = await loop.snapshot(wait=0.2)  # idle: exact at once
        assert first["steps"] == 0 and "stale" not in first
        engine.scheduler.running = ["r"]
        engine.work.set()
        await loop.snapshot()  # wakes the engine thread, which answers, then starts its long step
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        during = await loop.snapshot(wait=0.2)
        waited = time.monotonic() - t0
        exact = await loop.snapshot()  # waits for the step to end
        loop.stop()
        return first, during, waited, exact

    first, during, waited, exact = asyncio.run(main())
    assert during["stale"] is True and during["running"] == 1 and waited < 0.5  # the figures before the step
    assert exact["steps"] == 1 and "stale" not in exact
