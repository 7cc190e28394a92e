"""The engine's one forward, for every family, on weights packed at load (astrai.infer.packed).

`FusedModel(model)` computes what `CausalLM.forward` computes (the same operations in the same
order, so the same numbers up to the matmuls' own blocking) with fewer and larger operations, for
every family the model package reads (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3, Mixtral,
Qwen3-MoE). Prefill, decode, the compiled decode (astrai.infer.compiled) and the CUDA graphs
(astrai.infer.cuda_graph) all run it; the model's own forward is left to training.

    embed (x sqrt(hidden), rounded: Gemma)
    per layer: norm -> q/k/v matmul (+ biases) -> q/k norms (Qwen3, Gemma 3) -> RoPE in place with
    the layer's tables -> attention (the context: K/V write, decode or ragged prefill, the layer's
    sliding window and softmax scale) -> o matmul + residual (Gemma: the output normalised first)
    -> norm -> gate/up matmul -> act(gate) * up -> down matmul + residual (Gemma: normalised first);
    a sparse layer routes instead (`experts_forward`)
    final norm; logits = head matmul, soft-capped when the config says so (Gemma)

RoPE uses cos/sin gathered once per step per distinct RoPE (`ctx.rope_tables`: Gemma 3's local
layers have their own), shared by the layers that use it, as x * cos + swap_halves(x) * sin_signed,
where sin_signed is sin with its first half negated: the same products and sum as Hugging Face's
x * cos + rotate_half(x) * sin (a negation is exact).

Experts: the router's softmax in float32 and its top k, renormalised or not, as the model routes
(astrai.model.layers.route); then one matmul per expert over the tokens routed to it, its output
times the routing weight added into the token's row in expert order, as the model adds them. Inside
a CUDA graph (`static=True`) the token count per expert cannot be read on the host, so each chosen
(token, expert) pair multiplies by its expert's weights gathered by index instead (the same sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.infer.packed import OWN_ROWS, Experts, Layer, pack
from astrai.model.layers import activation, at_least_float32, route


class FusedModel:
    def __init__(self, model):
        self.model = model
        c = model.config
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.offset = c.traits.gemma  # Gemma's (1 + w) norms, multiplied in float32
        self.scale = c.softmax_scale
        self.act_name = c.hidden_act
        self.act = activation(c.hidden_act)
        self.builds = 0  # how many times the weights were packed (tests watch the rebuilds)
        self.own_rows = OWN_ROWS
        # (AdapterBank, its Rows for the step) while a step with adapter tokens runs (astrai.infer.lora_bank), else None
        self.lora = None
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)pack the weights from the model's current ones, into the copies already there."""
        self.packed = pack(self.model, into=getattr(self, "packed", None))
        self.layers: list[Layer] = self.packed.layers
        self.builds += 1

    def release(self) -> None:
        """Drop the packed copies (the engine sleeps); `rebuild` makes them again."""
        self.packed, self.layers = None, []

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.packed.embed)
        scale = self.packed.embed_scale
        return x if scale is None else x * scale

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx, static: bool = False) -> torch.Tensor:
        """hidden [T, H] after the final norm, as CausalLM.forward returns it. `static`: no operation
        whose shapes depend on values (CUDA graph capture)."""
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, position_ids, ctx, static)
        return self.norm(x, self.packed.norm)

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self.packed
        return self.model.cap_logits(hidden @ p.head_t if p.head_t is not None else F.linear(hidden, p.head))

    def _layer(self, i: int, w: Layer, x, position_ids, ctx, static: bool):
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        lora = self.lora  # LoRA adapters' terms, added to each projection group's output
        own = self.own_rows[0] <= t <= self.own_rows[1]  # the model's own weights, one matmul per projection
        h = self.norm(x, w.attn_norm)
        if own:
            qkv = torch.cat([F.linear(h, *w.own[n]) for n in ("q", "k", "v")], 1)
        else:
            qkv = h @ w.qkv_t if w.qkv_b is None else torch.addmm(w.qkv_b, h, w.qkv_t)
        qkv = _plus(qkv, lora and lora[0].delta(i, "qkv", h, lora[1]))
        qkv = qkv.view(t, hq + 2 * hkv, d)
        qk = qkv[:, :hq + hkv]
        if w.qk_norm is not None:
            qk = self.norm(qk, w.qk_norm)
        tables = ctx.rope_tables(position_ids, w.rope)
        if tables is not None:
            rope_in_place(qk, *tables)
            q, k = qk[:, :hq], qk[:, hq:]
        else:  # the backend applies RoPE itself (a fused kernel)
            q, k = ctx.rotary(qk[:, :hq], qk[:, hq:], position_ids, w.rope)
        o = ctx.attend(i, q, k, qkv[:, hq + hkv:], window=w.window, scale=self.scale).reshape(t, hq * d)
        x = self._residual(x, o, w.own["o"][0].t() if own else w.o_t, w.o_b, w.attn_out_norm,
                           lora and lora[0].delta(i, "o", o, lora[1]))
        h = self.norm(x, w.ffn_norm)
        if w.experts is not None:
            y = experts_forward(h, w.experts, self.act, static)
            return x + (y if w.ffn_out_norm is None else self.norm(y, w.ffn_out_norm))
        extra = lora and lora[0].delta(i, "gate_up", h, lora[1])
        if own and extra is None:
            act = self.act(F.linear(h, *w.own["gate"])).mul_(F.linear(h, *w.own["up"]))
        else:
            if own:
                gu = torch.cat([F.linear(h, *w.own["gate"]), F.linear(h, *w.own["up"])], 1)
            else:
                gu = h @ w.gate_up_t if w.gate_up_b is None else torch.addmm(w.gate_up_b, h, w.gate_up_t)
            gu = _plus(gu, extra)
            inter = gu.shape[-1] // 2
            act = self.act(gu[:, :inter]).mul_(gu[:, inter:])
        return self._residual(x, act, w.down_t, w.down_b, w.ffn_out_norm,
                              lora and lora[0].delta(i, "down", act, lora[1]))

    def _residual(self, x, a, weight_t, bias, out_norm, extra=None):
        """x + (a @ weight_t + bias + extra), the branch normalised first where the family does (Gemma);
        `extra`: the adapters' low-rank term of the projection, or None."""
        if out_norm is None and bias is None and extra is None:
            return torch.addmm(x, a, weight_t)
        y = a @ weight_t if bias is None else torch.addmm(bias, a, weight_t)
        y = _plus(y, extra)
        return x + (y if out_norm is None else self.norm(y, out_norm))


def _plus(y: torch.Tensor, extra) -> torch.Tensor:
    return y if extra is None else y + extra


def experts_forward(x: torch.Tensor, e: Experts, act, static: bool = False) -> torch.Tensor:
    """A sparse layer's output [T, H] for its normalised input x [T, H] (see the module docstring)."""
    weights, chosen = route(F.linear(x, e.router), e.top_k, e.renormalise, e.cast_back)
    if static:
        return _experts_gathered(x, e, act, weights, chosen)
    out = torch.zeros_like(x)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, in token order
    start = 0
    for ex, n in enumerate(torch.bincount(flat, minlength=e.router.shape[0]).tolist()):
        if n == 0:
            continue
        pick = order[start:start + n]
        start += n
        token = pick // e.top_k
        gu = x[token] @ e.gate_up_t[ex]
        inter = gu.shape[-1] // 2
        y = (act(gu[:, :inter]).mul_(gu[:, inter:]) @ e.down_t[ex]) * weights.flatten()[pick, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _experts_gathered(x, e: Experts, act, weights, chosen) -> torch.Tensor:
    """The same with no value-dependent shape: each (token, chosen expert) pair through that expert's
    gathered weights, the pairs of a token added in expert order."""
    t, k = chosen.shape
    chosen, perm = chosen.sort(dim=-1)  # the grouped path adds a token's experts in expert order
    weights = weights.gather(1, perm)
    flat = chosen.flatten()
    xs = x[:, None, :].expand(t, k, x.shape[-1]).reshape(t * k, 1, x.shape[-1])
    gu = torch.bmm(xs, e.gate_up_t[flat])
    inter = gu.shape[-1] // 2
    y = torch.bmm(act(gu[..., :inter]).mul_(gu[..., inter:]), e.down_t[flat]).view(t, k, -1) * weights[..., None]
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + y[:, j].to(out.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """The model's RMSNorm over the last dimension; `weight` is astrai.infer.packed.norm_weight's (Gemma's
    1 + w when `offset`), of x's last dimension or broadcast to x (q/k norms stacked per head). In float32
    torch's rms_norm runs the same operations in C++ (bit-identical, fewer Python calls); in other dtypes
    it rounds once where Hugging Face rounds twice, so the model's formula is kept there."""
    if x.dtype in (torch.float32, torch.float64):
        if weight.shape == x.shape[-1:]:
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight
    h = at_least_float32(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype) if offset else weight * h.to(x.dtype)


def rope_tables(position_ids: torch.Tensor, rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin_signed) [T, 1, D] in the activations' dtype for `rope_in_place`, once per step."""
    cos, sin = rope.cos_sin(position_ids)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def rope_in_place(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """x [T, H, D] <- x * cos + swap_halves(x) * sin_signed (Hugging Face's half-split rotary)."""
    swapped = x.roll(x.shape[-1] // 2, -1)  # a copy: [x2, x1]
    swapped.mul_(sin_signed)
    x.mul_(cos).add_(swapped)
