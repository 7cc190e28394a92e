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

On a CPU with several threads the float32 products of a step of up to SPLIT_N_ROWS rows run as one
batched product of as many pieces as threads (`matmul`): MKL gives one or a few rows times a weight fewer
threads than it has (a single row: one), so a decode step would stream its weights on one core. bfloat16
products are oneDNN's, which spread over the threads themselves (a split runs them up to 2x slower).

bfloat16 or float16 weights on a CPU: the residual stream stays float32 (`stream`). Each projection's
input (a norm's output, attention's output, the activation) is rounded to the weights' dtype, the
product accumulates in float32 and is rounded once to that dtype, and its result is added to the float32
residual; the norms over the residual run in float32. Hugging Face's bf16 forward keeps the residual in
bf16, whose 8 significant bits lose the small updates that later layers add to the large activations
some models carry (SmolLM2's reach 2.5e4: one bf16 step there is 128). Those rounding errors flipped
SmolLM2's first greedy token on a 37-token prompt; with the float32 stream the error left is the weights'
and the products' own rounding. The hidden state returned by `forward` is rounded to the weights' dtype.

On a CPU where astrai's kernels are built (astrai.infer.native), a decode step of up to
native_layer.MAX_ROWS requests runs all its dense layers as one call of astrai's C++ operator
(astrai.infer.native_layer: the same operations and roundings as `_layer`); where it does not apply (adapters
being served, experts, another attention plan), a decode step's norms (`norm_in`) and RoPE run as one operation
each instead of torch's several, bf16 products as `gemv_bf16` (the packed weights are RowsWeight's then), and
int8/int4 ones as astrai's quantized products.

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

from typing import Optional

import torch
import torch.nn.functional as F

from astrai.infer import native, native_layer
from astrai.infer.native_layer import layer_spec
from astrai.infer.packed import OWN_ROWS, Experts, Layer, pack
from astrai.model.layers import activation, at_least_float32, route


class FusedModel:
    def __init__(self, model, quantize: Optional[str] = None, quantize_head: bool = False):
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
        self.threads = None  # the pieces of a split product (`split_parts`); None: torch's thread count
        # (AdapterBank, its Rows for the step) while a step with adapter tokens runs (astrai.infer.lora_bank), else None
        self.lora = None
        # int8 | int4: the projections (and the LM head with quantize_head) as astrai.infer.quantized weights,
        # multiplied at every row count by their own product (no `own` path)
        self.quantize, self.quantize_head = quantize, quantize_head
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)pack the weights from the model's current ones, into the copies already there."""
        self.packed = pack(self.model, getattr(self, "packed", None), self.quantize, self.quantize_head)
        self.layers: list[Layer] = self.packed.layers
        self.wdtype = self.packed.embed.dtype
        half = self.wdtype in (torch.bfloat16, torch.float16) and self.packed.embed.device.type == "cpu"
        # the residual stream's dtype: float32 under 16-bit weights on a CPU (module docstring), else the weights'
        self.stream: Optional[torch.dtype] = torch.float32 if half else None
        cpu = self.packed.embed.device.type == "cpu" and self.wdtype in (torch.float32, torch.bfloat16)
        self.norm_kernel = cpu and native.kernels() is not None  # `norm_in`
        # each layer's arguments to astrai's CPU layers operator for decode steps (astrai.infer.native_layer), or None
        self.native = [layer_spec(w, self) for w in self.layers]
        self.native_all = bool(self.native) and all(s is not None for s in self.native)  # one call for the step
        # the whole model's operator arguments, flattened once per pack (not at every step)
        self.native_flat = native_layer.flatten(self.native) if self.native_all else None
        self.builds += 1

    def release(self) -> None:
        """Drop the packed copies (the engine sleeps); `rebuild` makes them again."""
        self.packed, self.layers, self.native, self.native_all, self.native_flat = None, [], [], False, None

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.packed.embed)
        scale = self.packed.embed_scale
        x = x if scale is None else x * scale
        return x if self.stream is None else x.to(self.stream)

    def norm_in(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A projection's input: `to_weight_dtype(norm(x, weight))`. For the few float32 rows of a decode step
        on a CPU with astrai's kernels it is one operation of them (astrai.infer.native.rms_norm_cast: the
        same formula, the mean of squares summed in double), not three of torch's."""
        if self.norm_kernel and x.shape[0] <= NORM_KERNEL_ROWS and x.dtype == torch.float32 and x.dim() == 2 \
                and weight.dim() == 1 and weight.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.astrai.rms_norm_cast(x.contiguous(), weight, self.eps, self.wdtype == torch.bfloat16)
        return self.to_weight_dtype(self.norm(x, weight))

    def to_weight_dtype(self, h: torch.Tensor) -> torch.Tensor:
        """A projection's input in the weights' dtype (a no-op unless the stream is float32)."""
        return h if self.stream is None else h.to(self.wdtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx, static: bool = False) -> torch.Tensor:
        """hidden [T, H] after the final norm, as CausalLM.forward returns it. `static`: no operation
        whose shapes depend on values (CUDA graph capture)."""
        x = self.embed(input_ids)
        if self.native_all and self._native_step(x, ctx):
            y = self._native_layers(x, position_ids, ctx, range(len(self.layers)))
            if y is not None:
                return self.norm_in(y, self.packed.norm)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, position_ids, ctx, static)
        return self.norm_in(x, self.packed.norm)

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if p.head_t is None:
            return self.model.cap_logits(F.linear(hidden, p.head))
        return self.model.cap_logits(matmul(hidden, p.head_t, split_parts(hidden, self.threads)))

    def _layer(self, i: int, w: Layer, x, position_ids, ctx, static: bool):
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        if self.native and self.native[i] is not None and self._native_step(x, ctx):  # a model of mixed layers
            y = self._native_layers(x, position_ids, ctx, [i])
            if y is not None:
                return y
        lora = self.lora  # LoRA adapters' terms, added to each projection group's output
        h = self.norm_in(x, w.attn_norm)
        parts = split_parts(h, self.threads)  # h: in the weights' dtype, which decides
        # the model's own weights, one matmul per projection (unless the products are split)
        own = parts == 1 and self.own_rows[0] <= t <= self.own_rows[1] and isinstance(w.qkv_t, torch.Tensor)
        if own:
            qkv = torch.cat([F.linear(h, *w.own[n]) for n in ("q", "k", "v")], 1)
        else:
            qkv = matmul(h, w.qkv_t, parts, w.qkv_b)
        qkv = _plus(qkv, lora and lora[0].delta(i, "qkv", h, lora[1]))
        qkv = qkv.view(t, hq + 2 * hkv, d)
        qk = qkv[:, :hq + hkv]
        if w.qk_norm is not None:
            qk = self.norm(qk, w.qk_norm)
        tables = ctx.rope_tables(position_ids, w.rope)
        if tables is not None:
            if self.norm_kernel and t <= NORM_KERNEL_ROWS and qk.dtype == tables[0].dtype:
                torch.ops.astrai.rope_in_place(qk, *tables)  # astrai's CPU kernel: one operation, not four
            else:
                rope_in_place(qk, *tables)
            q, k = qk[:, :hq], qk[:, hq:]
        else:  # the backend applies RoPE itself (a fused kernel)
            q, k = ctx.rotary(qk[:, :hq], qk[:, hq:], position_ids, w.rope)
        o = ctx.attend(i, q, k, qkv[:, hq + hkv:], window=w.window, scale=self.scale).reshape(t, hq * d)
        x = self._residual(x, o, w.own["o"][0].t() if own else w.o_t, w.o_b, w.attn_out_norm,
                           lora and lora[0].delta(i, "o", o, lora[1]), parts)
        h = self.norm_in(x, w.ffn_norm)
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
                gu = matmul(h, w.gate_up_t, parts, w.gate_up_b)
            gu = _plus(gu, extra)
            inter = gu.shape[-1] // 2
            act = self.act(gu[:, :inter]).mul_(gu[:, inter:])
        return self._residual(x, act, w.down_t, w.down_b, w.ffn_out_norm,
                              lora and lora[0].delta(i, "down", act, lora[1]), parts)

    def _native_step(self, x: torch.Tensor, ctx) -> bool:
        """Whether a step may run astrai's CPU layers operator: a decode step of a few rows, no adapters."""
        return x.shape[0] <= native_layer.MAX_ROWS and self.lora is None and getattr(ctx, "decode", False)

    def _native_layers(self, x, position_ids, ctx, idx) -> Optional[torch.Tensor]:
        """Layers `idx` (consecutive) as one call of astrai's CPU operator (astrai.infer.native_layer), or None where
        the step's attention or RoPE is not the operator's (a prefill, another backend or plan: the Python layers
        run then)."""
        if not hasattr(ctx, "native_plan"):
            return None
        plans = {}
        k_cache, v_cache = ctx.native_caches()
        ks, vs, slots, counts, cos, sin = [], [], [], [], [], []
        for i in idx:
            w, spec = self.layers[i], self.native[i]
            if w.window not in plans:
                plans[w.window] = ctx.native_plan(w.window)
            plan, tables = plans[w.window], ctx.rope_tables(position_ids, w.rope)
            if plan is None or tables is None or tables[0].dtype != spec.dtype or k_cache[i].dtype != spec.dtype:
                return None
            ks.append(k_cache[i])
            vs.append(v_cache[i])
            slots.append(plan[1])
            counts.append(plan[2])
            cos.append(tables[0])
            sin.append(tables[1])
        whole = len(idx) == len(self.layers)
        tensors, cfg = self.native_flat if whole else native_layer.flatten([self.native[i] for i in idx])
        scale = self.d ** -0.5 if self.scale is None else self.scale
        return torch.ops.astrai.decode_layers(x.contiguous(), tensors, cfg, [self.eps, scale], ks, vs, plans[w.window][0],
                                              slots, counts, cos, sin)

    def _residual(self, x, a, weight_t, bias, out_norm, extra=None, parts=1):
        """x + (a @ weight_t + bias + extra), the branch normalised first where the family does (Gemma);
        `extra`: the adapters' low-rank term of the projection, or None; `parts`: see `matmul`."""
        if out_norm is None and bias is None and extra is None and isinstance(weight_t, torch.Tensor) \
                and x.dtype == a.dtype and not _splits(a, weight_t, parts):
            return torch.addmm(x, a, weight_t)
        y = _plus(matmul(a, weight_t, parts, bias), extra)
        return x + (y if out_norm is None else self.norm(y, out_norm))


def _plus(y: torch.Tensor, extra) -> torch.Tensor:
    return y if extra is None else y + extra


# steps of up to this many rows normalise with astrai's kernel (`FusedModel.norm_in`); longer ones with torch's,
# which spreads the rows over the threads
NORM_KERNEL_ROWS = 16

# CPU steps of at most SPLIT_K_ROWS rows split their products' inner dimension across torch's threads,
# steps of up to SPLIT_N_ROWS rows their output dimension; larger ones are MKL's own products
SPLIT_K_ROWS = 3
SPLIT_N_ROWS = 128


def split_parts(x: torch.Tensor, threads: Optional[int] = None) -> int:
    """How many pieces `matmul` splits a step's products into: `threads` (default torch's thread count)
    for a float32 CPU step of at most SPLIT_N_ROWS rows, else 1. MKL multiplies a few rows by a weight on fewer
    threads than it is given (one row: one thread); a batched product (bmm) of the pieces runs them side
    by side."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[0] > SPLIT_N_ROWS:
        return 1
    return torch.get_num_threads() if threads is None else threads


def _splits(a: torch.Tensor, w_t: torch.Tensor, parts: int) -> bool:
    if parts < 2:
        return False
    return w_t.shape[0 if a.shape[0] <= SPLIT_K_ROWS else 1] % parts == 0


def matmul(a: torch.Tensor, w_t: torch.Tensor, parts: int = 1, bias=None) -> torch.Tensor:
    """a [T, K] @ w_t [K, N] (+ bias). With parts > 1 (`split_parts`) the product runs as one batched
    product of `parts` pieces: K cut into equal pieces whose products are summed (the same products added
    in another order) for at most SPLIT_K_ROWS rows, N cut into equal column blocks otherwise. A quantized
    w_t (astrai.infer.quantized) runs its own product, whose kernel spreads over the threads itself."""
    if not isinstance(w_t, torch.Tensor):
        return w_t.product(a, bias)
    if not _splits(a, w_t, parts):
        return a @ w_t if bias is None else torch.addmm(bias, a, w_t)
    (t, k), n = a.shape, w_t.shape[1]
    if t <= SPLIT_K_ROWS:
        y = torch.bmm(a.reshape(t, parts, k // parts).transpose(0, 1), w_t.view(parts, k // parts, n)).sum(0)
    else:
        y = torch.bmm(a.expand(parts, t, k), w_t.view(k, parts, n // parts).transpose(0, 1))
        y = y.transpose(0, 1).reshape(t, n)
    return y if bias is None else y.add_(bias)


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
        if weight.shape == x.shape[-1:] and weight.dtype == x.dtype:
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
