"""Radix cache and page pool: hit lengths, exact prefix context, eviction order, reference safety."""

import pytest

from astrai.infer.allocator import OutOfPages, PageAllocator
from astrai.infer.cache import PagePool
from astrai.infer.radix import RadixCache
from astrai.infer.request import Request, SamplingParams


def make_req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def written(pool, req, n):
    """Pretend the model wrote K/V for the request's first n tokens."""
    assert pool.extend(req, n)
    req.kv_len = n


def test_allocator_refcounts_and_double_free():
    a = PageAllocator(4, 2)
    pages = a.alloc(3)
    assert pages == [0, 1, 2] and a.num_free == 1
    a.incref(1)
    a.decref(1)
    assert a.num_free == 1
    a.decref(1)
    assert a.num_free == 2
    with pytest.raises(RuntimeError):
        a.decref(1)
    with pytest.raises(OutOfPages):
        a.alloc(3)
    a.check()


def test_match_is_page_aligned_and_keeps_prefix_context():
    a = PageAllocator(16, 4)
    tree = RadixCache(a)
    seq = list(range(100, 112))  # 3 pages
    own = a.alloc(3)
    assert tree.insert(seq, own) == own
    assert tree.match(seq) == own
    assert tree.match(seq[:11]) == own[:2]  # 11 tokens: two complete pages only
    assert tree.match(seq[:8] + [7, 7, 7, 7]) == own[:2]
    # the same page of tokens under a different prefix is a different node: no hit
    assert tree.match([1, 2, 3, 4] + seq[4:8]) == []
    assert tree.match(seq[4:8]) == []


def test_attach_caps_hit_to_leave_one_token():
    pool = PagePool(num_pages=16, page_size=4, max_reqs=4, max_context=64)
    first = make_req(0, range(8))
    pool.attach(first)
    written(pool, first, 8)
    pool.release(first)  # both pages go to the tree
    again = make_req(1, range(8))  # identical prompt: the hit must leave its last token to compute
    assert pool.attach(again) == 4
    longer = make_req(2, list(range(8)) + [50])
    assert pool.attach(longer) == 8
    pool.check([again, longer])


def test_last_sampled_token_and_partial_page_stay_private():
    pool = PagePool(num_pages=16, page_size=4, max_reqs=4, max_context=64)
    req = make_req(0, range(6))
    pool.attach(req)
    written(pool, req, 6)
    req.tokens += [60, 61, 62]  # decoded two (written) and sampled one (never written)
    written(pool, req, 8)
    pool.release(req)
    assert pool.radix.num_nodes == 2  # positions 0..7: complete and written
    req2 = make_req(1, list(range(6)) + [60, 61, 62, 63])
    assert pool.attach(req2) == 8
    pool.check([req2])
    pool.release(req2)

    pool3 = PagePool(num_pages=16, page_size=4, max_reqs=4, max_context=64)
    req = make_req(0, range(7))
    pool3.attach(req)
    written(pool3, req, 7)
    req.tokens.append(70)  # sampled, not written: 7 written tokens are one complete page
    pool3.release(req)
    assert pool3.radix.num_nodes == 1


def test_duplicate_prefix_switches_to_tree_page():
    pool = PagePool(num_pages=16, page_size=2, max_reqs=4, max_context=64)
    a, b = make_req(0, [1, 2, 3, 4, 5]), make_req(1, [1, 2, 3, 4, 9])
    for r in (a, b):  # both admitted before either is cached: they compute the prefix twice
        pool.attach(r)
        written(pool, r, 5)
    pool.cache(a)
    pool.cache(b)
    assert b.pages[:2] == a.pages[:2]
    assert pool.alloc.num_free == 16 - 2 - 1 - 1  # the duplicate pages went back
    pool.check([a, b])
    assert pool.table.slots(b.row, 0, 4).tolist() == [a.pages[0] * 2, a.pages[0] * 2 + 1,
                                                      a.pages[1] * 2, a.pages[1] * 2 + 1]


def test_eviction_lru_leaves_first_and_never_referenced():
    a = PageAllocator(8, 1)
    tree = RadixCache(a)

    def cache(tokens):
        pages = a.alloc(len(tokens))
        tree.insert(tokens, pages)
        for p in pages:
            a.decref(p)  # the inserting request finished: only the tree holds them
        return pages

    p_abc = cache([1, 2, 3])        # path 1-2-3
    p_abd = tree.match([1, 2]) + cache_tail(a, tree, [1, 2], [4])  # shares 1-2, new leaf 4
    p_x = cache([9])
    tree.match([1, 2, 3])           # 1-2-3 is now the most recent; leaf [9] and [1,2,4] are older
    assert a.evictable == 5 and a.num_free == 3
    assert tree.evict(1) == 1
    assert a.refcount[p_abd[-1]] == 0  # leaf 4 (used before 9 was inserted) went first
    assert tree.evict(1) == 1 and a.refcount[p_x[0]] == 0
    # a live request holds 1-2-3: nothing left is evictable
    for p in p_abc:
        a.incref(p)
    assert a.evictable == 0 and tree.evict(10) == 0
    for p in p_abc:
        a.decref(p)
    assert tree.evict(10) == 3 and a.num_free == 8 and tree.num_nodes == 0
    a.check()


def cache_tail(a, tree, prefix, tail):
    pages = tree.match(prefix) + a.alloc(len(tail))
    for p in pages[:len(prefix)]:
        a.incref(p)
    tree.insert(prefix + tail, pages)
    for p in pages:
        a.decref(p)
    return pages[len(prefix):]


def test_evict_parent_only_after_its_children():
    a = PageAllocator(4, 1)
    tree = RadixCache(a)
    pages = a.alloc(3)
    tree.insert([1, 2, 3], pages)
    for p in pages:
        a.decref(p)
    tree.match([1])  # the root-side node is the most recently used, still it cannot go before its child
    assert tree.evict(1) == 1 and a.refcount[pages[2]] == 0 and a.refcount[pages[0]] == 1


def test_reset_prefix_cache_forgets_every_prefix_and_old_kv_never_returns():
    """After the weights change: nothing cached before matches, a request that was running keeps its pages
    until it ends and then frees them instead of caching them, and the references stay exact."""
    pool = PagePool(num_pages=16, page_size=4, max_reqs=4, max_context=64)
    done = make_req(0, range(12))
    pool.attach(done)
    written(pool, done, 12)
    pool.release(done)  # 3 pages in the tree, held by nobody else
    running = make_req(1, range(8))
    assert pool.attach(running) == 4  # holds a cached page (capped: one token left to compute)
    written(pool, running, 8)
    pool.check([running])
    pool.reset_prefix_cache()
    assert pool.radix.num_nodes == 0 and pool.alloc.evictable == 0
    pool.check([running])
    assert pool.alloc.num_free == 16 - len(running.pages)
    pool.release(running)  # its K/V is of the old weights: freed, not cached
    assert pool.radix.num_nodes == 0 and pool.alloc.num_free == 16
    fresh = make_req(2, range(12))
    assert pool.attach(fresh) == 0
    written(pool, fresh, 12)
    pool.release(fresh)  # a request of the new epoch caches as before
    assert pool.radix.num_nodes == 3
    pool.check([])
