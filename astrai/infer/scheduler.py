"""Continuous batching: which tokens of which requests the next forward computes.

Every step (one model forward) the scheduler builds a ragged batch:
  1. every running request gets work: one token for a request in decode, the next chunk of its
     prompt for one still in (chunked) prefill; decode first so generation never stalls behind a
     long prompt. A request that needs a page and finds none (even after evicting unreferenced
     cached pages) makes the scheduler preempt the most recently admitted running request: its
     pages are released (its written pages go to the radix cache, when on) and it goes back to the
     front of the queue to be recomputed later (tokens so far = prompt + output, so its output
     continues exactly where it stopped).
  2. then waiting requests are admitted in arrival order (no overtaking, so none starves) while
     the step's token budget, the running-request limit and memory allow: its cached prefix is
     attached, then pages for its first chunk are taken from free plus evictable memory, keeping
     one page per running request in reserve so admission does not force a preemption next step.
Each step computes at most `max_step_tokens` tokens; a longer prompt is prefilled in chunks.

A request whose prompt plus max_tokens can never fit the pool (or the table's max context) is
refused at `add` with the numbers and the fix, never queued to hang.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from astrai.infer.cache import PagePool, pages_for
from astrai.infer.request import FINISHED, RUNNING, WAITING, Request


class RequestTooLarge(ValueError):
    """The request cannot fit the KV pool or the context limit even alone."""


@dataclass
class Batch:
    """One step's work: request i computes tokens[kv_len : kv_len + q_lens[i]] (kv_len before the step)."""

    reqs: list[Request] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)

    def add(self, req: Request, n: int) -> None:
        self.reqs.append(req)
        self.q_lens.append(n)

    def remove(self, req: Request) -> None:
        for i, r in enumerate(self.reqs):
            if r is req:
                del self.reqs[i], self.q_lens[i]
                return

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def samples(self, i: int) -> bool:
        """Whether request i reaches the end of its tokens this step (its last logits pick a token)."""
        return self.reqs[i].kv_len + self.q_lens[i] == len(self.reqs[i].tokens)


class Scheduler:
    def __init__(self, pool: PagePool, max_running: int = 64, max_step_tokens: int = 2048,
                 max_context: int | None = None):
        if not 1 <= max_running <= max_step_tokens:
            # every running request must get its decode token in every step, or the tail would starve
            raise ValueError(f"need 1 <= max_running <= max_step_tokens, got {max_running}, {max_step_tokens}")
        self.pool = pool
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_context = min(max_context or pool.max_context, pool.max_context)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_admitted_tokens = 0  # len(tokens) of each admission (re-admissions after preemption too)
        self.num_cached_tokens = 0  # of those, served by the radix cache

    # ---- queue ----
    def refusal(self, num_prompt: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run (None: it can). Reads only fixed sizes: any thread may ask."""
        # The last sampled token is never written, so a request needs prompt + max_tokens - 1 positions.
        positions = num_prompt + max_tokens - 1
        need = pages_for(positions, self.pool.page_size)
        if positions > self.max_context:
            return (f"{num_prompt} prompt tokens + max_tokens {max_tokens} exceed the context limit of "
                    f"{self.max_context} tokens; shorten the prompt or lower max_tokens")
        if need > self.pool.num_pages:
            return (f"{num_prompt} prompt tokens + max_tokens {max_tokens} need {need} KV pages, the pool has "
                    f"{self.pool.num_pages}; give the cache more memory or lower max_tokens")
        return None

    def add(self, req: Request) -> None:
        why = self.refusal(req.num_prompt, req.params.max_tokens)
        if why is not None:
            raise RequestTooLarge(f"request {req.rid}: {why}")
        req.status = WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Finished or aborted: give back its memory (written pages go to the radix cache)."""
        if req.status == FINISHED:
            return
        if req.status == WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self.pool.release(req)
        req.status = FINISHED
        req.finish_reason = reason

    # ---- one step ----
    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_step_tokens
        decoding = [r for r in self.running if r.remaining == 1]
        prefilling = [r for r in self.running if r.remaining > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status != RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.remaining, budget)
            if self._grow_or_preempt(req, req.kv_len + n, batch):
                batch.add(req, n)
            budget = self.max_step_tokens - batch.num_tokens
        self._admit(batch, budget)
        return batch

    def _grow_or_preempt(self, req: Request, n_positions: int, batch: Batch) -> bool:
        while not self.pool.extend(req, n_positions):
            victim = self.running[-1]
            self._preempt(victim)
            batch.remove(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req)
        req.status = WAITING
        req.stats.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _shares_uncached_prefix(self, req: Request, batch: Batch) -> bool:
        """Whether a request admitted in this step is computing a page-aligned prefix of req's prompt that
        the radix cache does not hold yet: waiting one step lets req reuse it instead of computing it twice."""
        ps = self.pool.page_size
        for other in batch.reqs:
            if other.kv_len != 0 or other.num_output:
                continue  # only requests whose prompt is computed from scratch in this step
            n = 0
            limit = min(len(other.tokens), len(req.tokens) - 1)
            while n < limit and other.tokens[n] == req.tokens[n]:
                n += 1
            if n >= ps and other.kv_len + batch.q_lens[batch.reqs.index(other)] >= n:
                return True
        return False

    def _admit(self, batch: Batch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.pool.radix is not None and self._shares_uncached_prefix(req, batch):
                return  # (in arrival order: nobody overtakes it)
            cached = self.pool.attach(req)
            n = min(req.remaining, budget)
            need = pages_for(req.kv_len + n, self.pool.page_size) - len(req.pages)
            if need + len(self.running) > self.pool.available() or not self.pool.extend(req, req.kv_len + n):
                self.pool.release(req)
                return
            self.waiting.popleft()
            req.status = RUNNING
            req.stats.cached_tokens += cached
            self.num_admitted_tokens += len(req.tokens)
            self.num_cached_tokens += cached
            self.running.append(req)
            batch.add(req, n)
            budget -= n

    def advance(self, batch: Batch) -> None:
        """After the forward: the computed tokens' K/V is written. Prompts just completed go to the radix
        cache so requests admitted later can share them while this one decodes."""
        for req, n in zip(batch.reqs, batch.q_lens):
            req.kv_len += n
            req.stats.computed_tokens += n
            if n > 1 and req.remaining == 0:
                self.pool.cache(req)
