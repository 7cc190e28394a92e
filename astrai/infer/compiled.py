"""The decode step through torch.compile (CPU): one compiled layer function shared by every layer.

`CompiledDecode(fused, backend, context, scratch_page)` runs a decode step (one new token per
request) of the engine's forward (astrai.infer.fused, any family) with each layer a call of one
compiled function whose weights, caches and step tensors are its inputs: the same graph serves all
layers, so the model is compiled once, not once per layer. Inductor fuses each layer's elementwise
work into a few C++ loops around the matmuls: the norms (Gemma's sandwich norms and q/k norms
included), RoPE, the K/V write into the paged cache (in place), the gather of each request's K/V
through its slots, the attention scores, softmax and weighted sum (as reductions over the gathered
rows, never a copy of the K/V), the gated activation and the residual adds. A layer's sliding
window and RoPE are inputs too: a windowed layer gets the slots of each request's last `window`
positions, and its own cos/sin tables (Gemma 3's local layers). A sparse layer (Mixtral,
Qwen3-MoE) compiles up to its MoE input; its experts run eagerly (astrai.infer.fused.experts_forward:
how many tokens each expert gets is known only at run time).

Shapes are dynamic in the batch size and the K/V length, so one compile serves every step with two
or more requests and any context length (a batch of one has its own graph: torch specialises size
1). Requests of a step are padded to the longest K/V, the padding masked by -inf; prefill steps
keep the eager forward (compiling ragged prefill does not pay: its time is in the matmuls).

When: `warm_up()` runs both graphs on dummy inputs writing only the scratch page (the K/V storage's
page past the pool's, never handed out); the engine calls it at start when `EngineOptions.compile`
is set, so no request waits for a compile. It costs tens of seconds on a 2-core CPU the first time;
Inductor's on-disk cache makes a restart with the same model shapes much faster (see
bench/RESULTS.md for the figures).
"""

from __future__ import annotations

import types

import torch

from astrai.infer.backend import AttentionMeta
from astrai.infer.backends.torch_native import decode_kv_slots
from astrai.infer.cache import pages_for
from astrai.infer.fused import FusedModel, experts_forward, rms_norm
from astrai.infer.native import GEMV_ROWS, RowsWeight
from astrai.model.layers import activation


def decode_layer_fn(hq: int, hkv: int, d: int, eps: float, offset: bool, act: str, scale, kernels=None):
    """The decode layer as a pure function of tensors (what torch.compile traces). A None weight is a
    part the family lacks; gu_t None: a sparse layer, which returns (x, its MoE input). `kernels` (an
    astrai.infer.native.Kernels): the weights are RowsWeight's [out, in] tensors, multiplied by its
    bf16 operator inside the graph; else [in, out] tensors multiplied by `@`."""
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    act_fn = activation(act)

    def norm(x, w):
        return rms_norm(x, w, eps, offset)

    def mm(a, w):
        return a @ w if kernels is None else torch.ops.astrai.gemv_bf16(a, w, kernels.bf16_isa, GEMV_ROWS)

    def layer(x, attn_norm, qkv_t, qkv_b, qk_norm, o_t, o_b, attn_out_norm, ffn_norm, gu_t, gu_b, down_t, down_b,
              ffn_out_norm, cos, sin, k_cache, v_cache, write_slots, kv_slots, kv_bias):
        b, wd = x.shape[0], qkv_t.dtype  # x: float32 under 16-bit weights (fused's stream); casts else no-ops
        qkv = mm(norm(x, attn_norm).to(wd), qkv_t)
        if qkv_b is not None:
            qkv = qkv + qkv_b
        qkv = qkv.view(b, hq + 2 * hkv, d)
        qk = qkv[:, :hq + hkv]
        if qk_norm is not None:
            qk = norm(qk, qk_norm)
        qk = qk * cos + qk.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2) * sin
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
        k_cache.index_copy_(0, write_slots, k)
        v_cache.index_copy_(0, write_slots, v)
        keys = k_cache[kv_slots]  # [B, L, Hkv, D]: fused into the reductions below, not materialised
        values = v_cache[kv_slots]
        scores = (q.reshape(b, 1, hkv, group, d) * keys[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hkv, G]
        p = torch.softmax(scores + kv_bias[:, :, None, None], dim=1)
        a = mm((p[..., None] * values[:, :, :, None, :]).sum(1).reshape(b, hq * d).to(wd), o_t)
        if o_b is not None:
            a = a + o_b
        x = x + (a if attn_out_norm is None else norm(a, attn_out_norm))
        h = norm(x, ffn_norm).to(wd)
        if gu_t is None:
            return x, h
        gu = mm(h, gu_t)
        if gu_b is not None:
            gu = gu + gu_b
        inter = gu.shape[-1] // 2
        y = mm(act_fn(gu[:, :inter]) * gu[:, inter:], down_t)
        if down_b is not None:
            y = y + down_b
        return x + (y if ffn_out_norm is None else norm(y, ffn_out_norm))

    # a code object of its own: dynamo keeps its graphs per code object, up to recompile_limit (8) of them,
    # and every model's layer function would otherwise be the one code object above (engines of several
    # models in one process, or one after another, would exhaust the limit and fail to compile)
    return types.FunctionType(layer.__code__.replace(), layer.__globals__, layer.__name__, layer.__defaults__,
                              layer.__closure__)


def _t(w):
    """A packed weight as the tensor the compiled layer multiplies by (a RowsWeight's [out, in] one)."""
    return w.w if isinstance(w, RowsWeight) else w


class CompiledDecode:
    def __init__(self, fused: FusedModel, backend, context, scratch_page: int, page_size: int):
        """`context(backend, meta, write_slots, decode=True)` makes a step's attention context (the
        runner's PagedContext: its meta, write slots and per-RoPE tables are what this reads)."""
        self.fused, self.backend, self._ctx_cls = fused, backend, context
        self.k_cache, self.v_cache = backend.k_cache, backend.v_cache
        self.scratch_page, self.page_size = scratch_page, page_size
        first = fused.layers[0].qkv_t
        fn = decode_layer_fn(fused.hq, fused.hkv, fused.d, fused.eps, fused.offset, fused.act_name, fused.scale,
                             first.kernels if isinstance(first, RowsWeight) else None)
        self.layer = torch.compile(fn, dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> torch.Tensor:
        """hidden [B, H] after the final norm for a decode step (ctx: its PagedContext)."""
        f = self.fused
        x = f.embed(input_ids)
        kv = {}  # window -> (slots [B, L], bias [B, L]: 0 where valid, -inf on padding)
        for i, w in enumerate(f.layers):
            if w.window not in kv:
                slots, valid = decode_kv_slots(ctx.meta, w.window)
                kv[w.window] = (slots, torch.zeros(valid.shape, dtype=x.dtype).masked_fill_(~valid, float("-inf")))
            cos, sin = ctx.rope_tables(position_ids, w.rope)
            out = self.layer(x, w.attn_norm, _t(w.qkv_t), w.qkv_b, w.qk_norm, _t(w.o_t), w.o_b, w.attn_out_norm,
                             w.ffn_norm, _t(w.gate_up_t), w.gate_up_b, _t(w.down_t), w.down_b, w.ffn_out_norm, cos, sin,
                             self.k_cache[i], self.v_cache[i], ctx.slots, *kv[w.window])
            if w.experts is None:
                x = out
                continue
            x, h = out
            y = experts_forward(h, w.experts, f.act)
            x = x + (y if w.ffn_out_norm is None else f.norm(y, w.ffn_out_norm))
        return f.to_weight_dtype(f.norm(x, f.packed.norm))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the graphs (a batch of one and of several, dense and sparse layers) on dummy steps
        whose K/V reads and writes stay in the scratch page."""
        ps, dev = self.page_size, self.k_cache[0].device
        slot = self.scratch_page * ps
        for b in (1, 2):
            meta = AttentionMeta.build([1] * b, [3] * b, [[self.scratch_page] * pages_for(3, ps)] * b, ps, device=dev)
            ctx = self._ctx_cls(self.backend, meta, torch.full((b,), slot, dtype=torch.long, device=dev), True)
            self(torch.zeros(b, dtype=torch.long, device=dev), torch.full((b,), 2, dtype=torch.long, device=dev), ctx)
