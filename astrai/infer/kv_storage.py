"""The two flat tables under the KV cache: the token-level K/V storage and the request-to-token table.

KVStorage: per layer, `k_cache` and `v_cache` of shape [num_slots, kv_heads, head_dim], where
num_slots = num_pages * page_size and slot = page * page_size + offset. A slot is one token's K/V
in one layer; which slots belong to which request is decided elsewhere (allocator, radix cache).

ReqToTokenTable: row r of a [max_reqs, max_context] int64 tensor maps the positions of the request
that holds row r to its slots, so a step finds where to write new K/V with one indexing op. It is
rewritten page by page whenever the request's page list changes.
"""

from __future__ import annotations

import torch


class KVStorage:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_slots, kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ReqToTokenTable:
    def __init__(self, max_reqs: int, max_context: int, page_size: int, device: str | torch.device = "cpu"):
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self.page_size = page_size
        self.max_context = max_context
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=device)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("request-to-token table full (the scheduler admits at most max_running requests)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def set_pages(self, row: int, first_page_index: int, pages: list[int]) -> None:
        """Positions of pages[first_page_index:] of the request, page by page."""
        if not pages:
            return
        ps = self.page_size
        start = first_page_index * ps
        end = start + len(pages) * ps
        if end > self.max_context:
            raise ValueError(f"request needs {end} positions, the table holds {self.max_context}")
        slots = torch.tensor(pages, dtype=torch.int64, device=self.table.device)[:, None] * ps + self._offsets
        self.table[row, start:end] = slots.reshape(-1)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.table[row, start:end]
