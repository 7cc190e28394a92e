"""ModelRunner: one scheduler Batch -> one forward of the shared model (astrai.model) -> next-token logits.

The batch is flattened (input_ids [T], position_ids [T]) as the model expects. The step's
AttentionMeta and the K/V write slots are built here once and shared by every layer through
`PagedContext`, the model's AttentionContext for generation: RoPE through the backend (with the
positions the K/V is stored under), then write K/V, then attend (decode when every request of the
step has exactly one new token, ragged prefill otherwise). Only the last position of each request
that samples goes through the LM head.

The forward is the engine's one forward for every family (astrai.infer.fused, on weights packed
at load by astrai.infer.packed). Decode steps, whose inputs go into preallocated buffers
(`DecodeInputs`), may instead run compiled (`compile`, CPU: astrai.infer.compiled) or as replayed
CUDA graphs (`cuda_graphs`, a GPU with the cuda backend: astrai.infer.cuda_graph), both over that
same forward's weights. Before each step `sync_weights()` looks for changed weights
(astrai.infer.packed.WeightWatch) and packs them again. The LM head multiplies by the packed head
(on CPU a transposed contiguous copy: MKL streams [hidden, vocab] faster for a decode step's few
rows, and the head is the largest single product of a small model's decode step).
"""

from __future__ import annotations

import torch

from astrai.infer.backend import AttentionBackend, AttentionMeta
from astrai.infer.cache import PagePool, pages_for
from astrai.infer.fused import FusedModel, rope_tables
from astrai.infer.packed import WeightWatch
from astrai.infer.scheduler import Batch
from astrai.model.attention import AttentionContext


class PagedContext(AttentionContext):
    def __init__(self, backend: AttentionBackend, meta: AttentionMeta, slots: torch.Tensor, decode: bool):
        self.backend, self.meta, self.slots, self.decode = backend, meta, slots, decode
        self._tables = {}

    def rope_tables(self, position_ids, rope):
        """(cos, sin_signed) of a RoPE for the step, gathered once and shared by the layers that use it;
        None when the backend applies RoPE itself (a fused kernel)."""
        if type(self.backend).rotary is not AttentionBackend.rotary:
            return None
        if id(rope) not in self._tables:
            self._tables[id(rope)] = rope_tables(position_ids, rope, self.backend.k_cache[0].dtype)
        return self._tables[id(rope)]

    def rotary(self, q, k, position_ids, rope):
        return self.backend.rotary(q, k, position_ids, rope)

    def native_plan(self, window=None):
        """(write slots, read slots, counts) of a decode step for astrai's CPU layers operator
        (astrai.infer.native_layer), or None: a prefill, or a backend or plan it does not run."""
        if not self.decode:
            return None
        plan = self.backend.native_plan(self.meta, window)
        return None if plan is None else (self.slots, *plan)

    def native_caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.backend.k_cache, self.backend.v_cache

    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        self.backend.write_kv(layer_idx, k, v, self.slots)
        if self.decode:
            return self.backend.decode(layer_idx, q, self.meta, window, scale)
        return self.backend.prefill(layer_idx, q, self.meta, window, scale)


class DecodeInputs:
    """Preallocated integer inputs of a decode step (one new token per request), sized by max_running:
    filled through numpy views each step instead of making new tensors (pinned and copied to the
    device on a GPU)."""

    def __init__(self, max_running: int, max_pages: int, device: torch.device):
        n = max_running
        sizes = {"ids": (n, torch.int64), "positions": (n, torch.int64), "slots": (n, torch.int64),
                 "qo_indptr": (n + 1, torch.int32), "kv_indptr": (n + 1, torch.int32), "kv_lens": (n, torch.int32),
                 "pages": (max_pages, torch.int32)}
        gpu = device.type == "cuda"
        self.host = {k: torch.zeros(m, dtype=dt, pin_memory=gpu) for k, (m, dt) in sizes.items()}
        self.dev = {k: t.to(device) for k, t in self.host.items()} if gpu else self.host
        self.host["qo_indptr"].copy_(torch.arange(n + 1))
        self.dev["qo_indptr"].copy_(self.host["qo_indptr"])

    def load(self, **values: list[int]) -> dict[str, torch.Tensor]:
        out = {}
        for name, v in values.items():
            self.host[name].numpy()[:len(v)] = v
            dev = self.dev[name][:len(v)]
            if dev is not self.host[name]:
                dev.copy_(self.host[name][:len(v)], non_blocking=True)
            out[name] = dev
        return out


class ModelRunner:
    def __init__(self, model, pool: PagePool, backend: AttentionBackend, device="cpu", compile: bool = False,
                 cuda_graphs: bool = False, quantize: tuple = (None, False)):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = torch.device(device)
        # raises UnservableModel for what it cannot compute; quantize: (int8 | int4 | None, LM head too)
        self.fused = FusedModel(model, *quantize)
        self.watch = WeightWatch(model)
        max_running = pool.table.table.shape[0]
        self.decode_inputs = DecodeInputs(max_running, max_running * pages_for(pool.max_context, pool.page_size),
                                          self.device)
        self.compiled = self._compiled_decode() if compile else None
        self.graphs = self._graph_decode() if cuda_graphs else None
        self.bank = None  # LoRA adapters served beside the base (astrai.infer.lora_bank), if any

    def sync_weights(self) -> bool:
        """Before a step: True if the model's weights changed since the last step (they are then packed
        again; K/V computed with the old weights is the caller's to drop)."""
        if not self.watch.changed():
            return False
        self.fused.rebuild()
        return True

    def release(self) -> None:
        """Drop the packed copies (the engine sleeps); the next `sync_weights` packs them again."""
        self.fused.release()
        self.watch.forget()

    def _scratch_page(self) -> int:
        if self.backend.k_cache[0].shape[0] < (self.pool.num_pages + 1) * self.pool.page_size:
            raise ValueError("compiled and graph decode need a scratch page after the pool's pages in the K/V storage")
        return self.pool.num_pages

    def _graph_decode(self):
        """CUDA graphs of the decode step, where they can run (else None: eager decode)."""
        from astrai.infer.backends.cuda import CudaBackend
        from astrai.infer.cuda_graph import GraphDecode

        if self.device.type != "cuda" or not isinstance(self.backend, CudaBackend):
            return None
        return GraphDecode(self.fused, self.backend, self.pool.table.table.shape[0], self.pool.max_context,
                           self.pool.page_size, self._scratch_page(), self.device, PagedContext)

    def _compiled_decode(self):
        from astrai.infer.backends.torch_native import TorchBackend
        from astrai.infer.compiled import CompiledDecode

        if self.device.type != "cpu" or not isinstance(self.backend, TorchBackend):
            raise ValueError("compile is for the CPU (torch attention backend); on a GPU decode runs as CUDA graphs")
        decode = CompiledDecode(self.fused, self.backend, PagedContext, self._scratch_page(), self.pool.page_size)
        decode.warm_up()
        return decode

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fused.logits(hidden)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, PagedContext, list[int]]:
        if all(n == 1 for n in batch.q_lens):
            return self._prepare_decode(batch)
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
        return torch.tensor(ids, dtype=torch.long, device=dev), pos, PagedContext(self.backend, meta, slots, False), last

    def _prepare_decode(self, batch: Batch):
        """The same for a step of one new token per request, into the preallocated DecodeInputs: the
        write slot comes from the request's page list, no table lookup."""
        ps = self.pool.page_size
        ids, positions, slots, kv_lens, kv_indptr, pages, flat = [], [], [], [], [0], [], []
        for req in batch.reqs:
            p = req.kv_len
            ids.append(req.tokens[p])
            positions.append(p)
            slots.append(req.pages[p // ps] * ps + p % ps)
            kv_lens.append(p + 1)
            own = req.pages[:p // ps + 1]
            pages.append(own)
            flat += own
            kv_indptr.append(len(flat))
        b = len(ids)
        t = self.decode_inputs.load(ids=ids, positions=positions, slots=slots, kv_lens=kv_lens, kv_indptr=kv_indptr,
                                    pages=flat)
        meta = AttentionMeta(self.decode_inputs.dev["qo_indptr"][:b + 1], t["kv_indptr"], t["pages"], t["kv_lens"], ps,
                             host={"qo_indptr": list(range(b + 1)), "kv_lens": kv_lens, "kv_indptr": kv_indptr,
                                   "pages": pages})
        last = [i for i in range(b) if batch.samples(i)]
        return t["ids"], t["positions"], PagedContext(self.backend, meta, t["slots"], True), last

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [n_sampling, vocab] (float32) for the requests of the batch that sample, in batch order."""
        decode = all(n == 1 for n in batch.q_lens)
        adapters = [r.adapter for r in batch.reqs]
        if self.bank is not None and any(adapters):  # the eager forward, each token with its adapter's term
            ids, pos, ctx, last = self.prepare(batch)
            self.fused.lora = (self.bank, self.bank.rows(adapters, batch.q_lens, self.fused.packed.embed.dtype,
                                                         self.device))
            try:
                hidden = self.fused(ids, pos, ctx)
            finally:
                self.fused.lora = None
        elif decode and self.graphs is not None:
            hidden = self.graphs(batch.reqs)
            last = [i for i in range(len(batch.reqs)) if batch.samples(i)]
        else:
            ids, pos, ctx, last = self.prepare(batch)
            hidden = (self.compiled if decode and self.compiled is not None else self.fused)(ids, pos, ctx)
        if not last:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        if len(last) < hidden.shape[0]:
            hidden = hidden[torch.tensor(last, device=hidden.device)]
        return self.logits(hidden).float()
