"""The decode step through torch.compile (CPU): one compiled layer function shared by every layer.

`CompiledDecode(fused, k_cache, v_cache)` runs a decode step (one new token per request) of the
fused model (astrai.infer.fused) with each layer a call of one compiled function whose weights,
caches and step tensors are its inputs: the same graph serves all layers, so the model is compiled
once, not once per layer. Inductor fuses each layer's elementwise work into a few C++ loops around
the matmuls: rms_norm, RoPE, the K/V write into the paged cache (in place), the gather of each
request's K/V through its slots, the attention scores, softmax and weighted sum (as reductions over
the gathered rows, never a copy of the K/V), the SwiGLU product and the residual adds.

Shapes are dynamic in the batch size and the K/V length, so one compile serves every step with two
or more requests and any context length (a batch of one has its own graph: torch specialises size
1). Requests of a step are padded to the longest K/V, the padding masked by -inf; prefill steps
keep the eager fused forward (compiling ragged prefill does not pay: its time is in the matmuls).

When: `warm_up()` runs both graphs on dummy inputs; the engine calls it at start when
`EngineOptions.compile` is set, so no request waits for a compile. It costs tens of seconds on a
2-core CPU the first time; Inductor's on-disk cache makes a restart with the same model shapes
much faster (see bench/RESULTS.md for the figures).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.infer.fused import FusedModel, rms_norm


def decode_layer_fn(hq: int, hkv: int, d: int, eps: float):
    """The decode layer as a pure function of tensors (what torch.compile traces)."""
    group = hq // hkv
    scale = d ** -0.5

    def layer(x, ln1, qkv_t, qkv_b, o_t, ln2, gu_t, down_t, cos, sin, k_cache, v_cache, write_slots, kv_slots,
              kv_bias):
        b = x.shape[0]
        h = F.rms_norm(x, x.shape[-1:], ln1, eps)
        qkv = h @ qkv_t
        if qkv_b is not None:
            qkv = qkv + qkv_b
        qkv = qkv.view(b, hq + 2 * hkv, d)
        qk = qkv[:, :hq + hkv]
        qk = qk * cos + qk.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2) * sin
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
        k_cache.index_copy_(0, write_slots, k)
        v_cache.index_copy_(0, write_slots, v)
        keys = k_cache[kv_slots]  # [B, L, Hkv, D]: fused into the reductions below, not materialised
        values = v_cache[kv_slots]
        scores = (q.reshape(b, 1, hkv, group, d) * keys[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hkv, G]
        p = torch.softmax(scores + kv_bias[:, :, None, None], dim=1)
        o = (p[..., None] * values[:, :, :, None, :]).sum(1).reshape(b, hq * d)
        x = x + o @ o_t
        h = F.rms_norm(x, x.shape[-1:], ln2, eps)
        gu = h @ gu_t
        inter = gu.shape[-1] // 2
        return x + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ down_t

    return layer


class CompiledDecode:
    def __init__(self, fused: FusedModel, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]):
        self.fused, self.k_cache, self.v_cache = fused, k_cache, v_cache
        fn = decode_layer_fn(fused.hq, fused.hkv, fused.d, fused.eps)
        self.layer = torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, write_slots: torch.Tensor, kv_slots: torch.Tensor,
                 kv_bias: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """hidden [B, H] after the final norm. kv_slots [B, L]: the slots of each request's K/V
        (the new token's included), kv_bias [B, L]: 0 where valid, -inf on padding."""
        model = self.fused.model
        x = model.model.embed_tokens(input_ids)
        cos, sin = tables
        for i, w in enumerate(self.fused.layers):
            x = self.layer(x, w.ln1, w.qkv_t, w.qkv_bias, w.o_t, w.ln2, w.gate_up_t, w.down_t, cos, sin,
                           self.k_cache[i], self.v_cache[i], write_slots, kv_slots, kv_bias)
        return rms_norm(x, model.model.norm.weight, self.fused.eps)

    @torch.inference_mode()
    def warm_up(self, scratch_slot: int = 0) -> None:
        """Compile both graphs (a batch of one and of several) on dummy inputs writing one scratch slot
        whose K/V is restored afterwards, so the cache is left as it was."""
        from astrai.infer.fused import rope_tables

        dev = self.k_cache[0].device
        saved = [(k[scratch_slot].clone(), v[scratch_slot].clone()) for k, v in zip(self.k_cache, self.v_cache)]
        for b in (1, 2):
            ids = torch.zeros(b, dtype=torch.long, device=dev)
            slots = torch.full((b,), scratch_slot, dtype=torch.long, device=dev)
            kv = torch.full((b, 3), scratch_slot, dtype=torch.long, device=dev)
            bias = torch.zeros(b, 3, dtype=self.k_cache[0].dtype, device=dev)
            self(ids, slots, kv, bias, rope_tables(torch.zeros(b, dtype=torch.long, device=dev), self.fused.model.rope,
                                                   self.k_cache[0].dtype))
        for (k, v), (sk, sv) in zip(zip(self.k_cache, self.v_cache), saved):
            k[scratch_slot], v[scratch_slot] = sk, sv
