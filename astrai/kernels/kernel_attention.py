"""The attention-backend operations (rotary, write_kv, prefill, decode) on top of the kernels.

`KernelAttention` speaks the contract of astrai.infer.backend (caches [num_slots, Hkv, D] per
layer, AttentionMeta) and runs every operation through an executor: CuPy on a GPU
(astrai.infer.backends.cuda), or the CPU emulator in the tests, which is how the engine is checked
against the torch backend without a GPU. Per-step derived values (maxima of the lengths) are kept
in meta.scratch so every layer reuses them.
"""

from __future__ import annotations

import torch

from astrai.kernels import launch as kernels


class KernelAttention:
    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], executor):
        self.k_cache, self.v_cache, self.executor = k_cache, v_cache, executor

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope):
        """In place on q, k (returned for the caller's convenience). `rope` is astrai.model.rope.Rotary.

        Its table already covers max_position_embeddings, which bounds every position the engine
        schedules; the kernel writes NaN for a position outside it rather than synchronising here.
        """
        cos, sin = rope.table(q.device)
        half = rope.inv_freq.shape[0]  # rotary pairs; both halves of HF-style tables are equal
        kernels.rotary(q, k, positions.long(), cos[:, :half], sin[:, :half], getattr(rope, "interleaved", False),
                       self.executor)
        return q, k

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kernels.write_kv(k, v, self.k_cache[layer], self.v_cache[layer], slots.long(), self.executor)

    def _max(self, meta, key: str) -> int:
        if key not in meta.scratch:
            if key == "max_q_len":
                qo = meta.host.get("qo_indptr") or meta.qo_indptr.tolist()
                meta.scratch[key] = max((b - a for a, b in zip(qo, qo[1:])), default=0)
            else:
                meta.scratch[key] = max(meta.host.get("kv_lens") or meta.kv_lens.tolist(), default=0)
        return meta.scratch[key]

    def prefill(self, layer: int, q: torch.Tensor, meta, window=None, scale=None) -> torch.Tensor:
        return kernels.prefill(q, self.k_cache[layer], self.v_cache[layer], meta.qo_indptr, meta.kv_indptr,
                               meta.kv_page_indices, meta.kv_lens, meta.page_size, self._max(meta, "max_q_len"),
                               self.executor, scale=scale, window=window)

    def decode(self, layer: int, q: torch.Tensor, meta, window=None, scale=None) -> torch.Tensor:
        return kernels.decode(q, self.k_cache[layer], self.v_cache[layer], meta.kv_indptr, meta.kv_page_indices,
                              meta.kv_lens, meta.page_size, self._max(meta, "max_kv_len"), self.executor,
                              scale=scale, window=window)
