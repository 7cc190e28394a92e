"""ModelRunner: one scheduler Batch -> one forward of the shared model (astrai.model) -> next-token logits.

The batch is flattened (input_ids [T], position_ids [T]) as the model expects. The step's
AttentionMeta and the K/V write slots are built here once and shared by every layer through
`PagedContext`, the model's AttentionContext for generation: RoPE through the backend (with the
positions the K/V is stored under), then write K/V, then attend (decode when every request of the
step has exactly one new token, ragged prefill otherwise). Only the last position of each request
that samples goes through the LM head.

On CPU the LM head multiplies by a transposed, contiguous copy of its weight ([hidden, vocab]):
a decode step's [16, 64] x [64, 129282] took 2.6-3.0 ms that way against 4.2-4.4 ms through
F.linear on the [vocab, hidden] weight, [4, 512] 38 against 55 ms (one thread, bench/cpu_ops.py);
at [16, 256] the two are level within the noise (0.83-1.02x). The head is the largest cost of a
small model's decode step. The copy costs the head's size in memory once, and is remade if the
weight changes (its data pointer or version counter).
"""

from __future__ import annotations

import torch

from astrai.infer.backend import AttentionBackend, AttentionMeta
from astrai.infer.cache import PagePool, pages_for
from astrai.infer.scheduler import Batch
from astrai.model.attention import AttentionContext


class PagedContext(AttentionContext):
    def __init__(self, backend: AttentionBackend, meta: AttentionMeta, slots: torch.Tensor, decode: bool):
        self.backend, self.meta, self.slots, self.decode = backend, meta, slots, decode

    def rotary(self, q, k, position_ids, rope):
        return self.backend.rotary(q, k, position_ids, rope)

    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        self.backend.write_kv(layer_idx, k, v, self.slots)
        if self.decode:
            return self.backend.decode(layer_idx, q, self.meta, window, scale)
        return self.backend.prefill(layer_idx, q, self.meta, window, scale)


class ModelRunner:
    def __init__(self, model, pool: PagePool, backend: AttentionBackend, device="cpu"):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = torch.device(device)
        self._head_t: torch.Tensor | None = None
        self._head_key: tuple | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":
            return self.model.logits(hidden)
        w = self.model.lm_head.weight
        key = (w.data_ptr(), w._version)
        if key != self._head_key:
            self._head_t, self._head_key = w.detach().t().contiguous(), key
        return self.model.cap_logits(hidden @ self._head_t)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, PagedContext, list[int]]:
        ids, rows, positions, kv_lens, pages, last = [], [], [], [], [], []
        ps = self.pool.page_size
        for i, (req, n) in enumerate(zip(batch.reqs, batch.q_lens)):
            start, end = req.kv_len, req.kv_len + n
            ids.extend(req.tokens[start:end])
            positions.extend(range(start, end))
            rows.extend([req.row] * n)
            kv_lens.append(end)
            pages.append(req.pages[:pages_for(end, ps)])
            if batch.samples(i):
                last.append(len(ids) - 1)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        slots = self.pool.table.table[torch.tensor(rows, dtype=torch.long, device=dev), pos]
        meta = AttentionMeta.build(batch.q_lens, kv_lens, pages, ps, device=dev)
        ctx = PagedContext(self.backend, meta, slots, decode=all(n == 1 for n in batch.q_lens))
        return torch.tensor(ids, dtype=torch.long, device=dev), pos, ctx, last

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [n_sampling, vocab] (float32) for the requests of the batch that sample, in batch order."""
        ids, pos, ctx, last = self.prepare(batch)
        hidden = self.model(ids, pos, ctx)
        if not last:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.logits(hidden[torch.tensor(last, device=hidden.device)]).float()
