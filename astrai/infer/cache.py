"""PagePool: the request-facing side of the KV cache (allocator + radix cache + request-to-token table).

A request's life in the cache:
  `attach(req)`    takes a table row and, with the radix cache on, the longest cached prefix of the
                   request's tokens, capped so at least one token is left to compute (its logits
                   are needed); it holds a reference on every page of that prefix.
  `extend(req, n)` makes sure pages cover the request's first n positions, evicting unreferenced
                   cached pages when the free list is short; False (nothing changed) when even
                   that is not enough, so the scheduler can preempt someone.
  `cache(req)`     offers the request's complete pages whose K/V is written to the radix cache
                   (after its prompt is computed, so requests admitted later share it); where the
                   tree already held that prefix the request switches to the tree's page.
  `release(req)`   caches what it can, drops all the request's references and its table row
                   (finish, cancel, preemption alike).
  `reset_prefix_cache()`  after the model's weights changed: the tree forgets every prefix, and
                   requests attached before (whose K/V is of the old weights) never offer theirs.

Nothing here frees a page directly: a page returns to the free list when its last holder (a
request or the tree) lets go. `check(requests)` verifies the global invariant used by the tests:
every page is free or has exactly as many references as it has holders, and no slot is leaked.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from astrai.infer.allocator import PageAllocator
from astrai.infer.kv_storage import ReqToTokenTable
from astrai.infer.radix import RadixCache
from astrai.infer.request import Request


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, max_reqs: int, max_context: int,
                 use_radix: bool = True, device="cpu"):
        self.page_size = page_size
        self.alloc = PageAllocator(num_pages, page_size)
        self.radix = RadixCache(self.alloc) if use_radix else None
        self.table = ReqToTokenTable(max_reqs, max_context, page_size, device)
        self.max_context = max_context
        self.epoch = 0  # bumped by reset_prefix_cache: K/V of an older epoch is never cached

    @property
    def num_pages(self) -> int:
        return self.alloc.num_pages

    def available(self) -> int:
        """Pages a new allocation can get: free now plus evictable from the radix cache."""
        return self.alloc.num_free + self.alloc.evictable

    def usage(self) -> tuple[int, int, int]:
        """(free, cached, total) token slots: free pages, pages held only by the radix cache (reclaimable
        by eviction), all pages. With no live request every page is one or the other: free + cached == total."""
        ps = self.page_size
        cached = self.alloc.evictable if self.radix is not None else 0
        return self.alloc.num_free * ps, cached * ps, self.num_pages * ps

    def attach(self, req: Request) -> int:
        """Give the request a table row and its cached prefix; returns the number of cached tokens."""
        assert req.row is None and not req.pages and req.kv_len == 0
        req.row = self.table.alloc_row()
        req.cache_epoch = self.epoch
        if self.radix is None:
            return 0
        pages = self.radix.match(req.tokens[:len(req.tokens) - 1], req.adapter)
        for p in pages:
            self.alloc.incref(p)
        req.pages = pages
        req.kv_len = len(pages) * self.page_size
        self.table.set_pages(req.row, 0, pages)
        return req.kv_len

    def extend(self, req: Request, n_positions: int) -> bool:
        """Pages for positions [0, n_positions) of the request; False if memory cannot be found."""
        need = pages_for(n_positions, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if need > self.alloc.num_free:
            if self.radix is None or need > self.available():
                return False
            self.radix.evict(need - self.alloc.num_free)
        new = self.alloc.alloc(need)
        self.table.set_pages(req.row, len(req.pages), new)
        req.pages.extend(new)
        return True

    def reset_prefix_cache(self) -> None:
        self.epoch += 1
        if self.radix is not None:
            self.radix.drop_all()

    def cache(self, req: Request) -> None:
        if self.radix is None or req.cache_epoch != self.epoch:
            return
        n = req.kv_len // self.page_size  # complete pages with K/V written (never the last sampled token)
        if n == 0:
            return
        tree_pages = self.radix.insert(req.tokens[:n * self.page_size], req.pages[:n], req.adapter)
        for i, (own, tree) in enumerate(zip(req.pages[:n], tree_pages)):
            if own != tree:  # the prefix was already cached: hold the tree's page, drop our duplicate
                self.alloc.incref(tree)
                self.alloc.decref(own)
                req.pages[i] = tree
                self.table.set_pages(req.row, i, [tree])

    def release(self, req: Request) -> None:
        if req.row is None:
            return
        self.cache(req)
        for p in req.pages:
            self.alloc.decref(p)
        req.pages = []
        req.kv_len = 0
        self.table.free_row(req.row)
        req.row = None

    def check(self, live: Iterable[Request]) -> None:
        """Every page is free or referenced exactly once per holder (live requests + radix nodes), and a
        request that holds a cached page holds all its cached ancestors (what makes eviction safe)."""
        self.alloc.check()
        holders = Counter()
        nodes = {nd.page: nd for nd in self.radix.nodes()} if self.radix is not None else {}
        for req in live:
            held = set(req.pages)
            if len(held) != len(req.pages):
                raise AssertionError(f"request {req.rid} holds a page twice")
            if req.kv_len > len(req.pages) * self.page_size:
                raise AssertionError(f"request {req.rid}: kv_len {req.kv_len} beyond its {len(req.pages)} pages")
            for p in held & nodes.keys():
                nd = nodes[p].parent
                while nd.page is not None:
                    if nd.page not in held:
                        raise AssertionError(f"request {req.rid} holds cached page {p} but not its ancestor {nd.page}")
                    nd = nd.parent
            holders.update(req.pages)
        if self.radix is not None and len(nodes) != self.radix.num_nodes:
            raise AssertionError("two radix nodes hold the same page")
        if self.radix is not None and {nd for nd in nodes.values() if not nd.children} != self.radix._leaves:
            raise AssertionError("the radix cache's leaf set disagrees with the tree")
        holders.update(nodes.keys())
        for p in range(self.num_pages):
            if self.alloc.refcount[p] != holders.get(p, 0):
                raise AssertionError(f"page {p}: refcount {self.alloc.refcount[p]}, holders {holders.get(p, 0)}")
            if self.alloc.in_tree[p] != (p in nodes):
                raise AssertionError(f"page {p}: in_tree flag disagrees with the tree")
