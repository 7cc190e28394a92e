"""Page allocator with reference counts: the only owner of "is this page free?".

The KV pool is cut into `num_pages` pages of `page_size` token slots (slot = page * page_size +
offset). A page is either on the free list (refcount 0) or held: its refcount is the number of
holders, where a holder is a live request that has the page in its page list or the radix cache
node that stores it. Nobody frees a page directly; holders drop their reference and the page goes
back to the free list when the last one does.

The allocator also knows which pages the radix cache holds (`in_tree`), so it can keep, in O(1),
the number of pages that are evictable: held by the tree and by nobody else. Together with the
radix cache's rule that a request holding a cached page also holds every cached ancestor of it
(see radix.py), such a page and its whole subtree can be freed by evicting leaves.

Guarantee checked by `check()`: free pages have refcount 0 and appear once on the free list; held
pages are not on it; page 0..num_pages-1 are each in exactly one of the two states.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Raised by `alloc` when fewer pages are free than asked (the caller evicts or preempts first)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.in_tree = [False] * num_pages
        # Popped from the end: pages come out in ascending order, which keeps small pools readable in tests.
        self._free = list(range(num_pages - 1, -1, -1))
        self.evictable = 0  # pages held only by the radix cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with refcount 1 (held by the caller)."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, page: int) -> None:
        rc = self.refcount[page]
        if rc == 0:
            raise RuntimeError(f"incref of free page {page}")
        if self.in_tree[page] and rc == 1:
            self.evictable -= 1
        self.refcount[page] = rc + 1

    def decref(self, page: int) -> None:
        rc = self.refcount[page] - 1
        if rc < 0:
            raise RuntimeError(f"decref of free page {page} (double free)")
        self.refcount[page] = rc
        if self.in_tree[page] and rc == 1:
            self.evictable += 1
        if rc == 0:
            if self.in_tree[page]:
                raise RuntimeError(f"page {page} freed while the radix cache still holds it")
            self._free.append(page)

    def mark_in_tree(self, page: int, flag: bool) -> None:
        """The radix cache took (flag=True) or dropped (False) its reference; call after incref / before decref."""
        if self.in_tree[page] == flag:
            raise RuntimeError(f"page {page} in_tree already {flag}")
        self.in_tree[page] = flag
        if self.refcount[page] == 1:
            self.evictable += 1 if flag else -1

    def check(self) -> None:
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a page is on the free list twice")
        on_list = set(free)
        for p in range(self.num_pages):
            if (p in on_list) != (self.refcount[p] == 0):
                raise AssertionError(f"page {p}: refcount {self.refcount[p]} but on free list = {p in on_list}")
        n_evictable = sum(1 for p in range(self.num_pages) if self.in_tree[p] and self.refcount[p] == 1)
        if n_evictable != self.evictable:
            raise AssertionError(f"evictable count {self.evictable} != {n_evictable}")
