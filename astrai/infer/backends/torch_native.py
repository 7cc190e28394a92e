"""The always-available attention backend: gather K/V through the page table, then PyTorch SDPA.

Prefill loops over the requests of the ragged batch (their lengths differ a lot, padding them
together would waste more than the loop costs). A request with cached K/V before its new tokens
needs a bottom-right causal mask, and SDPA with an explicit mask computes every block of the
q_len x kv_len rectangle; on CPU it is split instead into attention over the cached prefix (no mask)
and causal attention over the new tokens, merged by their log-sum-exps (the CPU flash kernel
returns them), which skips the masked-out blocks (bench/cpu_ops.py). Decode pads all requests to the longest K/V and runs one
SDPA call with a length mask (on a CPU with astrai's kernels, astrai::decode_attention: the same softmax
read through the slots, no gathered copy). Slot indices and masks are derived from the meta once per step
(kept in meta.scratch, per window) and reused by every layer.

A sliding-window layer (window W) reads only the K/V it can see: prefill gathers from position
max(0, cached - W + 1) and attends in query blocks of W (astrai.model.attention.banded_sdpa);
decode gathers each request's last W positions (no cascade: a shared prefix may be out of view).
The softmax scale is the layer's (SDPA's default 1/sqrt(D) when None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.infer import native
from astrai.infer.backend import AttentionBackend, AttentionMeta
from astrai.model.attention import banded_sdpa

# new tokens from which the split pays (below, the masked call is as fast and one call fewer)
SPLIT_MIN_Q = 32
# shared prefix tokens from which decode runs as a cascade
CASCADE_MIN_TOKENS = 64
# the CPU flash kernel, which returns the log-sum-exp that merging two partial attentions needs
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _merge(o1, l1, o2, l2, dtype) -> torch.Tensor:
    """Attention over keys A and B from its two parts: o_i, with l_i = log-sum-exp of its scores."""
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_()[..., None], (l2 - m).exp_()[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(dtype)


def shared_prefix_pages(pages: list[list[int]], kv_lens: list[int], page_size: int) -> int:
    """Leading pages that every request holds (the same physical pages: a radix-shared prefix), full
    pages only, leaving each request at least one token of its own."""
    if len(pages) < 2:
        return 0
    n, first = (min(kv_lens) - 1) // page_size, pages[0]
    for p in pages[1:]:
        m, limit = 0, min(n, len(p))
        while m < limit and p[m] == first[m]:
            m += 1
        n = m
        if n == 0:
            break
    return n


def _split_attention(q, k, v, cached: int, scale) -> torch.Tensor:
    """Bottom-right causal attention of q [1, Hq, n, D] over k/v [1, Hkv, cached + n, D] as two flash
    calls (the cached prefix, fully visible; the new tokens, causal) merged by log-sum-exp. The flash
    kernel maps query head h to K/V head h // (Hq / Hkv) itself."""
    o1, l1 = _FLASH_CPU(q, k[:, :, :cached], v[:, :, :cached], scale=scale)
    o2, l2 = _FLASH_CPU(q, k[:, :, cached:], v[:, :, cached:], is_causal=True, scale=scale)
    return _merge(o1, l1, o2, l2, q.dtype)


def _page_slots(meta: AttentionMeta) -> torch.Tensor:
    """[B, max_pages * page_size] slot of each K/V position (padded rows point at slot 0, masked)."""
    pages_per_req = meta.kv_indptr[1:] - meta.kv_indptr[:-1]
    max_pages = max(int(pages_per_req.max()), 1) if meta.batch_size else 1
    idx = meta.kv_indptr[:-1, None].long() + torch.arange(max_pages, device=meta.kv_indptr.device)
    valid = torch.arange(max_pages, device=idx.device) < pages_per_req[:, None]
    pages = torch.where(valid, meta.kv_page_indices[idx.clamp(max=max(len(meta.kv_page_indices) - 1, 0))], 0)
    offsets = torch.arange(meta.page_size, device=idx.device)
    return (pages.long()[:, :, None] * meta.page_size + offsets).reshape(meta.batch_size, -1)


def decode_kv_slots(meta: AttentionMeta, window: int | None = None,
                    slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] slots, [B, L] valid) of the K/V each request's new token attends to: all its positions,
    or in a sliding-window layer its last `window` (fewer when shorter), left-aligned and padded to the
    longest (a padded position points at a request's slot or slot 0, and is not valid)."""
    slots = _page_slots(meta) if slots is None else slots
    max_kv = max(meta.host["kv_lens"]) if meta.batch_size else 0
    lens = meta.kv_lens.long()
    if window is None or max_kv <= window:
        valid = torch.arange(max_kv, device=slots.device)[None, :] < lens[:, None]
        return slots[:, :max_kv], valid
    idx = (lens - window).clamp(min=0)[:, None] + torch.arange(window, device=slots.device)
    valid = idx < lens[:, None]
    return slots.gather(1, idx.clamp(max=slots.shape[1] - 1)), valid


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]):
        super().__init__(k_cache, v_cache)
        # decode's padded plan runs astrai's CPU kernel (astrai.infer.native) where it is built
        self.cpu_kernel = bool(k_cache) and k_cache[0].device.type == "cpu" and native.kernels() is not None

    def _prefill_plan(self, meta: AttentionMeta, window):
        key = "torch_prefill" if window is None else ("torch_prefill", window)
        plan = meta.scratch.get(key)
        if plan is None:
            slots = _page_slots(meta)
            qo, kv_lens = meta.host["qo_indptr"], meta.host["kv_lens"]
            plan = []
            for b, kv_len in enumerate(kv_lens):
                q_len = qo[b + 1] - qo[b]
                mask, cached, first = None, kv_len - q_len, 0
                if window is not None and kv_len > window:
                    first = max(0, cached - window + 1)  # the oldest position any new token can see
                elif cached and (q_len < SPLIT_MIN_Q or _FLASH_CPU is None or slots.device.type != "cpu"):
                    # query i sits at position cached + i
                    q_pos = torch.arange(cached, kv_len, device=slots.device)
                    mask = torch.arange(kv_len, device=slots.device)[None, :] <= q_pos[:, None]
                plan.append((qo[b], qo[b + 1], slots[b, first:kv_len], mask, cached, first))
            meta.scratch[key] = plan
        return plan

    def prefill(self, layer: int, q: torch.Tensor, meta: AttentionMeta, window=None, scale=None) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        out = torch.empty_like(q)
        gqa = q.shape[1] != k_cache.shape[1]
        for start, end, slots, mask, cached, first in self._prefill_plan(meta, window):
            # 4-D on purpose: on CPU, 3-D inputs take SDPA's slower math path
            qb = q[start:end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            kb = k_cache.index_select(0, slots).transpose(0, 1)[None]  # [1, Hkv, kv_len - first, D]
            vb = v_cache.index_select(0, slots).transpose(0, 1)[None]
            if window is not None and cached + (end - start) > window:
                o = banded_sdpa(qb, kb, vb, cached, first, window, scale)
            elif cached and mask is None:
                o = _split_attention(qb, kb, vb, cached, scale)
            else:
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None,
                                                   scale=scale, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode_plan(self, meta: AttentionMeta, window):
        key = "torch_decode" if window is None else ("torch_decode", window)
        plan = meta.scratch.get(key)
        if plan is not None:
            return plan
        kv_lens, ps = meta.host["kv_lens"], meta.page_size
        slots = _page_slots(meta)
        if window is not None and max(kv_lens) > window:
            window_slots, valid = decode_kv_slots(meta, window, slots)
            plan = ("padded", window_slots, valid[:, None, None, :], valid.sum(-1))
            meta.scratch[key] = plan
            return plan
        shared = 0
        if _FLASH_CPU is not None and slots.device.type == "cpu" and "pages" in meta.host:
            shared = shared_prefix_pages(meta.host["pages"], kv_lens, ps) * ps
        if shared >= CASCADE_MIN_TOKENS:
            own = meta.kv_lens.long() - shared
            max_own = max(kv_lens) - shared
            own_slots = slots[:, shared:shared + max_own]
            pad = torch.arange(max_own, device=slots.device)[None, :] >= own[:, None]
            # the flash kernel takes an additive mask of the query's dtype, not a boolean one
            add = torch.zeros(pad.shape, dtype=self.k_cache[0].dtype, device=slots.device)
            add.masked_fill_(pad, float("-inf"))
            plan = ("cascade", slots[0, :shared], own_slots, add[:, None, None, :])
        else:
            slots, valid = decode_kv_slots(meta, None, slots)
            # a single request needs no mask: SDPA without one is faster (and exact); each request's valid
            # positions come first, `valid.sum(-1)` of them (the CPU kernel's counts)
            plan = ("padded", slots, None if meta.batch_size == 1 else valid[:, None, None, :], valid.sum(-1))
        meta.scratch[key] = plan
        return plan

    def native_plan(self, meta: AttentionMeta, window=None):
        """(slots [B, L], counts [B]) of a decode step's padded plan for astrai's CPU layers operator
        (astrai.infer.native_layer), or None where the step runs another plan or there are no kernels."""
        if not self.cpu_kernel:
            return None
        plan = self._decode_plan(meta, window)
        if plan[0] != "padded":
            return None
        if not plan[1].is_contiguous():  # made contiguous once per step, kept in the plan for the other layers
            plan = (plan[0], plan[1].contiguous(), *plan[2:])
            meta.scratch["torch_decode" if window is None else ("torch_decode", window)] = plan
        return plan[1], plan[3]

    def _gather(self, layer: int, slots: torch.Tensor):
        """K and V at slots [B, L] -> [B, Hkv, L, D] each. index_select on the flat slots, which
        CPU torch runs faster than advanced indexing with a 2-D index."""
        shape = (*slots.shape, *self.k_cache[layer].shape[1:])
        k = self.k_cache[layer].index_select(0, slots.reshape(-1)).view(shape).transpose(1, 2)
        v = self.v_cache[layer].index_select(0, slots.reshape(-1)).view(shape).transpose(1, 2)
        return k, v

    def decode(self, layer: int, q: torch.Tensor, meta: AttentionMeta, window=None, scale=None) -> torch.Tensor:
        plan = self._decode_plan(meta, window)
        if plan[0] == "cascade":
            _, shared_slots, own_slots, add_mask = plan
            ks, vs = self._gather(layer, shared_slots[None])  # [1, Hkv, shared, D]
            # the step's B queries as one sequence over the shared prefix, all of it visible: [1, Hq, B, D]
            o1, l1 = _FLASH_CPU(q.transpose(0, 1)[None], ks, vs, scale=scale)
            k, v = self._gather(layer, own_slots)
            o2, l2 = _FLASH_CPU(q[:, :, None, :], k, v, attn_mask=add_mask, scale=scale)  # [B, Hq, 1, D]
            return _merge(o1[0].transpose(0, 1), l1[0].transpose(0, 1), o2[:, :, 0], l2[:, :, 0], q.dtype)
        _, slots, mask, counts = plan
        if self.cpu_kernel and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == self.k_cache[layer].dtype:
            # astrai's CPU kernel reads the K/V through the slots (no gathered copy); the same softmax
            d = q.shape[-1]
            return torch.ops.astrai.decode_attention(q, self.k_cache[layer], self.v_cache[layer], slots, counts,
                                                     d ** -0.5 if scale is None else scale, native.kernels().int8_isa)
        k, v = self._gather(layer, slots)  # [B, Hkv, max_kv, D]
        o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o[:, :, 0, :]
