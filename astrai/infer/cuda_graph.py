"""Decode steps as CUDA graphs (a GPU with the `cuda` attention backend), as vLLM and SGLang run them.

A decode step launches a few hundred small kernels; replaying them as one captured graph removes the
launch and Python cost that dominates small batches. Graphs are captured per batch-size bucket (1,
2, 4, 8, then multiples of 8 up to max_running) over static device buffers; a step with B requests
replays the smallest bucket >= B after writing its inputs into the buffers' first B rows. The other
rows are padding: token 0 at position 0, writing its K/V into a scratch page the pool never hands
out (the engine's K/V storage has one page more than the pool) and attending to that one slot.

The graphs replay the engine's one forward (astrai.infer.fused), every family; a sparse layer's
experts run in its `static` form (each token's chosen experts gathered by index: no shape that
depends on the routing), since a captured graph cannot read per-expert token counts on the host.

What is fixed at capture and must stay valid: the packed weights' tensors (a rebuild after a weight
change makes new ones, so the graphs are dropped and captured again on the next step), the K/V
caches, the RoPE table, and the attention's split plan, which is made for the longest context the
pool allows (`max_context`) so every step fits it; splits past a request's length exit at once.

`plan_inputs` (the host side of a step: which numbers go into which buffer rows) is plain Python and
tested on the CPU; the capture and replay need a GPU (tests marked `gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.infer.backend import AttentionMeta
from astrai.infer.cache import pages_for


def buckets(max_running: int) -> list[int]:
    small = [b for b in (1, 2, 4) if b < max_running]
    return small + list(range(8, max_running, 8)) + [max_running]


def bucket_for(n: int, sizes: list[int]) -> int:
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"{n} requests in a decode step, the largest graph serves {sizes[-1]}")


@dataclass
class StepInputs:
    """One decode step's numbers for `bucket` rows (the first len(reqs) real, the rest padding)."""

    ids: list[int]
    positions: list[int]
    write_slots: list[int]
    kv_lens: list[int]
    kv_indptr: list[int]
    page_indices: list[int]


def plan_inputs(reqs, bucket: int, page_size: int, scratch_page: int) -> StepInputs:
    """reqs: requests with exactly one new token each (tokens, kv_len, pages)."""
    s = StepInputs([], [], [], [], [0], [])
    for req in reqs:
        pos = req.kv_len
        s.ids.append(req.tokens[pos])
        s.positions.append(pos)
        s.write_slots.append(req.pages[pos // page_size] * page_size + pos % page_size)
        s.kv_lens.append(pos + 1)
        s.page_indices.extend(req.pages[:pages_for(pos + 1, page_size)])
        s.kv_indptr.append(len(s.page_indices))
    for _ in range(bucket - len(reqs)):
        s.ids.append(0)
        s.positions.append(0)
        s.write_slots.append(scratch_page * page_size)
        s.kv_lens.append(1)
        s.page_indices.append(scratch_page)
        s.kv_indptr.append(len(s.page_indices))
    return s


class GraphDecode:
    def __init__(self, fused, backend, max_running: int, max_context: int, page_size: int, scratch_page: int,
                 device: torch.device, context):
        """`context(backend, meta, write_slots, decode=True)` makes the step's attention context (the
        runner's PagedContext), so this module needs nothing from the runner."""
        self.fused, self.backend, self.device = fused, backend, device
        self.page_size, self.scratch_page, self.max_context = page_size, scratch_page, max_context
        self.sizes = buckets(max_running)
        n, max_pages = self.sizes[-1], pages_for(max_context, page_size)
        self._ctx_cls = context
        sizes = {"ids": (n, torch.int64), "positions": (n, torch.int64), "write_slots": (n, torch.int64),
                 "kv_lens": (n, torch.int32), "kv_indptr": (n + 1, torch.int32),
                 "page_indices": (n * max_pages, torch.int32)}
        # static device buffers the graphs read, and pinned host copies a step's numbers go through
        self.dev = {k: torch.zeros(m, dtype=dt, device=device) for k, (m, dt) in sizes.items()}
        self.host = {k: torch.zeros(m, dtype=dt).pin_memory() for k, (m, dt) in sizes.items()}
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._built_for = None  # fused.builds the graphs were captured with
        self._pool = None

    def _forward(self, b: int) -> torch.Tensor:
        d = self.dev
        meta = AttentionMeta(self.qo_indptr[:b + 1], d["kv_indptr"][:b + 1], d["page_indices"], d["kv_lens"][:b],
                             self.page_size)
        meta.scratch["max_kv_len"] = self.max_context  # the split plan for the longest context
        ctx = self._ctx_cls(self.backend, meta, d["write_slots"][:b], decode=True)
        return self.fused(d["ids"][:b], d["positions"][:b], ctx, static=True)

    def capture(self, b: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (kernel modules, library handles)
            self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b)
        self._pool = graph.pool()
        self.graphs[b] = (graph, out)

    def _load(self, s: StepInputs) -> None:
        self._copied.synchronize()  # the previous step's copies have left the host buffers
        for name, values in vars(s).items():
            self.host[name].numpy()[:len(values)] = values
            self.dev[name][:len(values)].copy_(self.host[name][:len(values)], non_blocking=True)
        self._copied.record()

    @torch.inference_mode()
    def __call__(self, reqs) -> torch.Tensor:
        """hidden [len(reqs), H] of a decode step (each request one new token)."""
        if self._built_for != self.fused.builds:  # new weight tensors: the old graphs point at freed memory
            self.graphs.clear()
            self._pool = None
            self._built_for = self.fused.builds
        b = bucket_for(len(reqs), self.sizes)
        self._load(plan_inputs(reqs, b, self.page_size, self.scratch_page))
        if b not in self.graphs:
            self.capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:len(reqs)]
