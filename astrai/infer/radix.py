"""Radix prefix cache over KV pages: exact, page-aligned prefix sharing.

The tree has one node per cached page. An edge is labelled with the exact `page_size` token ids of
that page, so a node stands for the whole token prefix on the path from the root to it, never for
its page's tokens alone: two requests share a page only when every token before it is equal too
(a global hash of a page's tokens would wrongly share KV computed under a different context).

What goes in (the caller's duty, see cache.py): only complete pages whose KV has been written, so
the last sampled token of a request (never fed to the model) and a partial last page stay private.
A lookup is capped by the caller to leave at least one prompt token to compute (its logits are
needed to sample).

References: each node holds one reference on its page in the allocator. A request that uses a
cached page holds its own reference on it and on every cached ancestor (`match` returns the whole
path; `insert` returns the tree's page wherever one already existed, for the caller to hold
instead of its duplicate). Hence a page whose only reference is the tree's has a subtree whose
pages are also referenced only by the tree, and `evict` can free it by removing leaves first.

Eviction: unreferenced leaves (refcount 1, i.e. the tree's own) in least-recently-used order;
removing a leaf may expose its parent, which then competes by its own last use. A page a live
request holds, or one with a cached child, is never evicted.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence

from astrai.infer.allocator import PageAllocator


class Node:
    __slots__ = ("key", "page", "parent", "children", "last_access")

    def __init__(self, key: Optional[tuple], page: Optional[int], parent: Optional["Node"]):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator):
        self.alloc = allocator
        self.page_size = allocator.page_size
        self.root = Node(None, None, None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_evicted = 0  # pages freed by eviction, ever
        self._leaves: set[Node] = set()  # eviction looks at these only, not at the whole tree

    def _keys(self, tokens: Sequence[int], n_pages: int, salt: int = 0):
        """Each page's edge label: its token ids, led by `salt` when it is not 0 (a LoRA adapter's index:
        K/V computed under one adapter is never shared with another, nor with the base)."""
        ps = self.page_size
        lead = (("adapter", salt),) if salt else ()
        return (lead + tuple(tokens[i * ps:(i + 1) * ps]) for i in range(n_pages))

    def match(self, tokens: Sequence[int], salt: int = 0) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (computed under adapter `salt`), in complete
        pages. Marks the path as used."""
        node, pages, now = self.root, [], next(self._clock)
        for key in self._keys(tokens, len(tokens) // self.page_size, salt):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            pages.append(node.page)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: int = 0) -> list[int]:
        """Cache `pages` (whose KV holds `tokens`, len(tokens) == len(pages) * page_size).

        Returns the page the tree holds for each position: the caller's own page where it was new,
        the already cached one where the prefix was cached before (the caller should then hold that
        one and drop its duplicate).
        """
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"{len(tokens)} tokens for {len(pages)} pages of {self.page_size}")
        node, out, now = self.root, [], next(self._clock)
        for key, page in zip(self._keys(tokens, len(pages), salt), pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node)
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.alloc.incref(page)
                self.alloc.mark_in_tree(page, True)
                self.num_nodes += 1
            child.last_access = now
            out.append(child.page)
            node = child
        return out

    def _evictable_leaf(self, node: Node) -> bool:
        return node is not self.root and not node.children and self.alloc.refcount[node.page] == 1

    def evict(self, n_pages: int) -> int:
        """Free up to n_pages pages, least recently used unreferenced leaves first. Returns how many."""
        if n_pages <= 0 or self.alloc.evictable == 0:
            return 0
        heap = [(nd.last_access, id(nd), nd) for nd in self._leaves if self._evictable_leaf(nd)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_pages:
            _, _, nd = heapq.heappop(heap)
            parent = nd.parent
            self._remove(nd)
            freed += 1
            self.num_evicted += 1
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove(self, node: Node) -> None:
        del node.parent.children[node.key]
        self._leaves.discard(node)
        if not node.parent.children and node.parent is not self.root:
            self._leaves.add(node.parent)
        self.alloc.mark_in_tree(node.page, False)
        self.alloc.decref(node.page)
        self.num_nodes -= 1

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            yield nd

    def clear(self) -> int:
        """Evict everything no request holds (e.g. between benchmark runs)."""
        return self.evict(self.num_nodes)

    def drop_all(self) -> None:
        """Forget every cached prefix, also the pages requests still hold (they keep their own
        references): after the model's weights changed, no cached K/V may be matched again."""
        for nd in reversed(list(self.nodes())):  # (nodes() yields a parent before its children)
            self._remove(nd)
