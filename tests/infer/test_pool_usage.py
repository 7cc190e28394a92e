"""PagePool.usage(): free / cached / total token slots, as the server's /health reports them.

Reference: counted from the holders themselves (the radix tree's nodes and the live requests' page
lists), not from the allocator's counters that usage() reads.
"""

import random

import pytest

from astrai.infer.cache import PagePool
from astrai.infer.request import FINISHED, Request, SamplingParams
from astrai.infer.scheduler import Scheduler


def reference_usage(pool: PagePool, live) -> tuple[int, int, int]:
    held = {p for r in live for p in r.pages}
    tree = {nd.page for nd in pool.radix.nodes()} if pool.radix is not None else set()
    ps = pool.page_size
    used = held | tree
    cached = tree - held  # in the tree, no request holds it: reclaimable
    return (pool.num_pages - len(used)) * ps, len(cached) * ps, pool.num_pages * ps


@pytest.mark.parametrize("page_size,use_radix", [(1, True), (4, True), (4, False)])
def test_usage_matches_the_holders_and_adds_up_when_idle(page_size, use_radix):
    rng = random.Random(page_size + 10 * use_radix)
    pool = PagePool(num_pages=96 // page_size + 8, page_size=page_size, max_reqs=8, max_context=256,
                    use_radix=use_radix)
    sched = Scheduler(pool, max_running=8, max_step_tokens=40)
    shared = [rng.randrange(30) for _ in range(24)]
    live, rid = [], 0
    for step in range(600):
        while len(live) < 10 and rid < 400:
            prompt = (shared if rng.random() < 0.6 else []) + [rng.randrange(30) for _ in range(rng.randrange(1, 20))]
            req = Request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 10)))
            rid += 1
            sched.add(req)
            live.append(req)
        if live and rng.random() < 0.15:  # a client goes away: waiting, prefilling or decoding
            sched.finish(rng.choice(live), "abort")
        if sched.has_work():
            batch = sched.schedule()
            sampled = [r for i, r in enumerate(batch.reqs) if batch.samples(i)]
            sched.advance(batch)
            for r in sampled:
                r.tokens.append(rng.randrange(30))
                if r.num_output >= r.params.max_tokens:
                    sched.finish(r, "length")
        live = [r for r in live if r.status != FINISHED]
        assert pool.usage() == reference_usage(pool, sched.running)
        if not live:
            free, cached, total = pool.usage()
            assert free + cached == total
    for r in list(live):
        sched.finish(r, "abort")
    free, cached, total = pool.usage()
    assert free + cached == total == pool.num_pages * page_size
    assert (cached > 0) == use_radix  # the shared prefix stays cached, reclaimable
    pool.radix is not None and pool.radix.clear()
    assert pool.usage() == (total, 0, total)
