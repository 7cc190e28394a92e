"""Training operations on CPU through astrai's own kernels (astrai/kernels/cpu_attention.cpp, cpu_train.cpp).

Causal attention in bf16: torch's CPU flash-attention backward computes every score of each query block
against all keys, the causally masked half included, with products that reach a fraction of what oneDNN's
bf16 matrix product does on a CPU with AMX or AVX-512 BF16 (bench/RESULTS.md: 6.6-7.0 ms against 2.7-3.3 ms
per SmolLM2 layer at 512 tokens, 2 threads). `causal_attention(q, k, v, scale)` runs torch's forward
(`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp the backward needs) and,
for the gradients, `torch.ops.astrai.causal_attention_backward`: the products over the unmasked blocks only,
sums in float32. `attention_usable(q, k, v)` says whether a call takes it: bf16 CPU tensors of which one
needs a gradient, on a CPU with `avx512_bf16` or `amx_bf16` (elsewhere torch's backward is kept).

The gated MLP's activation: `swiglu(gate, up)` = silu(gate) * up, forward and backward each one pass of
`torch.ops.astrai.swiglu(_backward)` (torch runs five, each widening bf16 and rounding back), torch's own
arithmetic rounded where its operators round (equal to torch's results but for its scalar tails' libm exp);
`swiglu_usable(gate, up)`: float32 or bf16 CPU tensors alike, with or without gradients (a policy scored
without them, GRPO's old policy or DPO's reference, computes what its training forward computes, to the bit).

Rotary embedding: `rotary(x, cos, sin)` = x * cos + rotate_half(x) * sin (astrai.model.rope), forward and
backward each one pass of `torch.ops.astrai.rotary` (torch runs four to six), the same operations rounded where
torch's round: torch's results to the bit; `rotary_usable(x, cos)`: float32 or bf16 CPU tensors alike.

RMSNorm of float32 activations (a layer's input and post-attention norms: the residual stream is float32 in
fp32 and bf16-mixed training): `rms_norm(x, w, eps)` = w * (x * rsqrt(mean(x^2) + eps)), forward and backward
each one pass of `torch.ops.astrai.rms_norm(_backward)` (torch runs six and about ten), float32 throughout, the
sums in another order than torch's (a few float32 units apart); `rms_norm_usable(x, w)`, with or without
gradients, as swiglu.

All of them need AVX-512 (F, BW, VL), the kernels built (astrai.kernels.cpu_build), not torch.compile's tracing,
and `ASTRAI_NATIVE` neither 0 nor avx2 (what an AVX2-only CPU runs: torch's operators). The engine's own
layers (astrai.infer) compute their activation themselves.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from astrai.runtime.hardware import BF16_CPU_FLAGS, cpu_flags

BLOCK = 128  # positions per block of the attention backward's products (bench/RESULTS.md: 64 and 128 alike at 512
# tokens, 128 faster from 1,024: 35.7 against 44.8 ms at 2,048)
_STATE: dict = {}  # "avx512": the kernels run here; "bf16": and the CPU multiplies bf16 fast (decided once)


def _ready(bf16_products: bool) -> bool:
    if "avx512" not in _STATE:
        flags = cpu_flags() or frozenset()
        # ASTRAI_NATIVE=avx2 asks for what an AVX2-only CPU runs: torch's operators here
        ok = os.environ.get("ASTRAI_NATIVE", "1") not in ("0", "avx2") and {"avx512f", "avx512bw", "avx512vl"} <= flags
        if ok:
            from astrai.kernels.cpu_build import built

            ok = built()
        _STATE["avx512"], _STATE["bf16"] = ok, ok and any(f in flags for f in BF16_CPU_FLAGS)
    return _STATE["bf16" if bf16_products else "avx512"]


def _training(*xs: torch.Tensor) -> bool:
    return (xs[0].device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in xs)
            and not torch.compiler.is_compiling())


def _elementwise(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels may take x: a CPU tensor, outside torch.compile's tracing, on a CPU they
    run on."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and _ready(bf16_products=False)


def attention_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether causal_attention runs for these [S, H, D] inputs (see the module docstring). Not for an empty
    sequence: torch's flash forward op, called directly, dies of a division by zero there (SIGFPE); SDPA
    handles it."""
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[0] > 0 and _training(q, k, v)
            and _ready(bf16_products=True))


def swiglu_usable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether swiglu runs for these inputs (see the module docstring)."""
    return (gate.dtype == up.dtype and gate.dtype in (torch.float32, torch.bfloat16) and gate.shape == up.shape
            and _elementwise(gate))


def rotary_usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rotary runs for x [T, H, D] and cos [T, D] (see the module docstring)."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 3 and x.shape[-1] % 2 == 0
            and cos.shape == (x.shape[0], x.shape[2]) and _elementwise(x))


def rms_norm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether rms_norm runs for x [..., H] and w [H] (see the module docstring)."""
    return x.dtype == w.dtype == torch.float32 and w.dim() == 1 and x.shape[-1] == w.shape[0] and _elementwise(x)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [S, H, D] with heads D apart and elements contiguous (rows may be further apart), as the kernel reads."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x  # (one head: its stride is never stepped over, and contiguous() may leave it as it is)
    return x.contiguous()


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        q, k, v = _rows(q), _rows(k), _rows(v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), 0.0, True, attn_mask=None, scale=scale)[:2]
        out = out[0].transpose(0, 1)  # [S, Hq, D]
        ctx.save_for_backward(q, k, v, out, lse[0])
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.astrai.causal_attention_backward(_rows(dout), q, k, v, _rows(out), lse, ctx.scale,
                                                                 BLOCK)
        return dq, dk, dv, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """Causal attention of one sequence, q [S, Hq, D], k/v [S, Hkv, D] bf16 -> [S, Hq, D]; `attention_usable`
    first."""
    return _CausalAttention.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else float(scale))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return torch.ops.astrai.swiglu(gate, up)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        return tuple(torch.ops.astrai.swiglu_backward(dh.contiguous(), gate, up))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; `swiglu_usable` first."""
    return _SwiGLU.apply(gate, up)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return torch.ops.astrai.rotary(x.contiguous(), cos, sin, False)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return torch.ops.astrai.rotary(g.contiguous(), cos, sin, True), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos, sin [T, D] contiguous in x's dtype; `rotary_usable` first."""
    return _Rotary.apply(x, cos, sin)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y, r = torch.ops.astrai.rms_norm(x2, w.contiguous(), eps)
        ctx.save_for_backward(x2, w, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, w, r = ctx.saved_tensors
        dx, dw = torch.ops.astrai.rms_norm_backward(g.reshape(x2.shape).float().contiguous(), x2, w.contiguous(), r,
                                                     ctx.needs_input_grad[1])
        return dx.view(ctx.shape), (dw if ctx.needs_input_grad[1] else None), None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (x * rsqrt(mean(x^2, -1) + eps)) for float32 x [..., H], w [H]; `rms_norm_usable` first."""
    return _RMSNorm.apply(x, w, float(eps))
