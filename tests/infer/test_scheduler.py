"""Scheduler + page pool without a model: random traffic invariant, chunking, preemption, never-fits."""

import random

import pytest

from astrai.infer.cache import PagePool
from astrai.infer.request import FINISHED, RUNNING, Request, SamplingParams
from astrai.infer.scheduler import RequestTooLarge, Scheduler


def run_step(sched, rng, vocab=5):
    """One fake forward: K/V written for the batch, a token sampled where the batch reached the end."""
    batch = sched.schedule()
    sampled = [r for i, r in enumerate(batch.reqs) if batch.samples(i)]
    sched.advance(batch)
    for r in sampled:
        r.tokens.append(rng.randrange(vocab))
        if r.num_output >= r.params.max_tokens:
            sched.finish(r, "length")
    return batch


@pytest.mark.parametrize("page_size,use_radix", [(1, True), (4, True), (16, True), (4, False)])
def test_random_traffic_never_leaks_or_double_holds(page_size, use_radix):
    rng = random.Random(page_size * 7 + use_radix)
    pool = PagePool(num_pages=max(12, 160 // page_size), page_size=page_size, max_reqs=8, max_context=256,
                    use_radix=use_radix)
    sched = Scheduler(pool, max_running=8, max_step_tokens=48)
    system_prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    live, done, rid, steps = [], 0, 0, 0
    hits = 0  # prompt tokens served from the radix cache
    while done < 1500:
        while len(live) < 12 and rid < 1500 + 50:
            prefix = rng.choice(system_prompts) if rng.random() < 0.7 else []
            prompt = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            req = Request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 12)))
            rid += 1
            sched.add(req)
            live.append(req)
        if rng.random() < 0.08:  # cancel a random live request (waiting, mid-prefill or decoding)
            victim = rng.choice(live)
            sched.finish(victim, "abort")
        batch = run_step(sched, rng)
        steps += 1
        assert batch.num_tokens <= 48 and len(batch.reqs) <= 8
        pool.check(sched.running)
        for r in sched.waiting:
            assert not r.pages and r.row is None and r.kv_len == 0
        finished = [r for r in live if r.status == FINISHED]
        done += len(finished)
        hits += sum(r.stats.cached_tokens for r in finished)
        live = [r for r in live if r.status != FINISHED]
        assert steps < 20000, "no progress"
    for r in list(live):
        sched.finish(r, "abort")
    pool.check([])
    assert sched.num_preemptions > 0  # the pool was small enough to exercise preemption...
    if use_radix:
        assert hits > 0 and pool.radix.num_evicted > 0  # ...prefix hits and eviction
        pool.radix.clear()
    assert pool.alloc.num_free == pool.num_pages  # nothing leaked
    assert pool.table.num_free_rows == 8


def test_chunked_prefill_and_ragged_batch():
    pool = PagePool(num_pages=64, page_size=4, max_reqs=4, max_context=128, use_radix=False)
    sched = Scheduler(pool, max_running=4, max_step_tokens=16)
    long = Request(0, list(range(40)), SamplingParams(max_tokens=2))
    short = Request(1, list(range(5)), SamplingParams(max_tokens=2))
    sched.add(long)
    sched.add(short)
    b = sched.schedule()
    assert [r.rid for r in b.reqs] == [0] and b.q_lens == [16] and not b.samples(0)
    sched.advance(b)
    b = sched.schedule()
    assert [r.rid for r in b.reqs] == [0] and b.q_lens == [16]
    sched.advance(b)
    b = sched.schedule()  # the rest of the long prompt plus the whole short one, in one ragged step
    assert [r.rid for r in b.reqs] == [0, 1] and b.q_lens == [8, 5] and b.samples(0) and b.samples(1)
    sched.advance(b)
    long.tokens.append(1)
    short.tokens.append(1)
    b = sched.schedule()
    assert b.q_lens == [1, 1]


def test_preemption_when_memory_runs_out_then_recompute():
    # 6 pages of 2: two requests of 4 prompt tokens each fit, growing to 7 positions each does not.
    pool = PagePool(num_pages=6, page_size=2, max_reqs=4, max_context=64, use_radix=False)
    sched = Scheduler(pool, max_running=4, max_step_tokens=64)
    a = Request(0, [1, 2, 3, 4], SamplingParams(max_tokens=4))
    b = Request(1, [5, 6, 7, 8], SamplingParams(max_tokens=4))
    sched.add(a)
    sched.add(b)
    rng = random.Random(0)
    batches = []
    while sched.has_work():
        batches.append(run_step(sched, rng))
        pool.check(sched.running)
    assert sched.num_preemptions >= 1 and b.stats.preemptions >= 1 and a.stats.preemptions == 0
    assert a.num_output == 4 and b.num_output == 4
    # b was recomputed from scratch: its prompt plus the output it had so far went through prefill again
    assert b.stats.computed_tokens > b.num_prompt + b.num_output - 1
    assert pool.alloc.num_free == 6


def test_request_that_can_never_fit_is_refused():
    pool = PagePool(num_pages=4, page_size=4, max_reqs=2, max_context=64)
    sched = Scheduler(pool, max_running=2, max_step_tokens=64)
    with pytest.raises(RequestTooLarge, match="need 5 KV pages, the pool has 4"):
        sched.add(Request(0, list(range(10)), SamplingParams(max_tokens=8)))
    with pytest.raises(RequestTooLarge, match="context limit of 64"):
        sched.add(Request(1, list(range(60)), SamplingParams(max_tokens=8)))
    sched.add(Request(2, list(range(10)), SamplingParams(max_tokens=7)))  # 16 positions: exactly fits
    assert not sched.running


def test_admission_counts_evictable_pages():
    pool = PagePool(num_pages=4, page_size=2, max_reqs=2, max_context=64)
    sched = Scheduler(pool, max_running=2, max_step_tokens=64)
    a = Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    sched.add(a)
    run_step(sched, random.Random(0))
    assert a.status == FINISHED and pool.alloc.num_free == 2 and pool.alloc.evictable == 2
    b = Request(1, [9, 9, 9, 9, 9, 9, 9], SamplingParams(max_tokens=1))  # 4 pages: needs the cached two
    sched.add(b)
    batch = sched.schedule()
    assert batch.reqs == [b] and b.status == RUNNING and pool.radix.num_nodes == 0


def test_request_waits_a_step_for_a_prefix_being_computed():
    pool = PagePool(num_pages=64, page_size=4, max_reqs=4, max_context=128)
    sched = Scheduler(pool, max_running=4, max_step_tokens=64)
    system = list(range(100, 116))
    a = Request(0, system + [1, 2, 3], SamplingParams(max_tokens=2))
    b = Request(1, system + [7, 8], SamplingParams(max_tokens=2))
    c = Request(2, [5, 6, 7], SamplingParams(max_tokens=2))  # behind b: arrival order is kept
    for r in (a, b, c):
        sched.add(r)
    batch = sched.schedule()
    assert batch.reqs == [a]
    sched.advance(batch)
    a.tokens.append(9)
    batch = sched.schedule()
    assert batch.reqs == [a, b, c] and b.stats.cached_tokens == 16 and batch.q_lens == [1, 2, 3]
    # without the radix cache nothing is gained by waiting
    pool = PagePool(num_pages=64, page_size=4, max_reqs=4, max_context=128, use_radix=False)
    sched = Scheduler(pool, max_running=4, max_step_tokens=64)
    for r in (Request(0, system + [1], SamplingParams()), Request(1, system + [2], SamplingParams())):
        sched.add(r)
    assert len(sched.schedule().reqs) == 2
