"""Causal attention for bf16 training on CPU: torch's flash forward, astrai's backward.

torch's CPU flash-attention backward computes every score of each query block against all keys, the
causally masked half included, with products that reach a fraction of what oneDNN's bf16 matrix product
does on a CPU with AMX or AVX-512 BF16 (bench/RESULTS.md: 6.6-7.0 ms against 2.7-3.3 ms per SmolLM2 layer at
512 tokens, 2 threads). `causal_attention(q, k, v, scale)` runs torch's forward
(`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp the backward needs) and,
for the gradients, `torch.ops.astrai.causal_attention_backward` (astrai/kernels/cpu_attention.cpp): the
products over the unmasked blocks only, sums in float32.

`usable(q, k, v)` says whether a call takes this path: bf16 CPU tensors of which one needs a gradient, a CPU
with `avx512_bf16` or `amx_bf16` (where oneDNN's bf16 products are fast; elsewhere torch's backward is kept),
the kernels built (astrai.kernels.cpu_build), not inside torch.compile's tracing, and `ASTRAI_NATIVE` not 0.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from astrai.runtime.hardware import BF16_CPU_FLAGS, cpu_flags

BLOCK = 64  # positions per block of the backward's products (64 and 128 ran alike at 512 tokens)
_STATE: dict = {}  # "ready": whether the kernel runs in this process, decided once


def _ready() -> bool:
    if "ready" not in _STATE:
        flags = cpu_flags() or frozenset()
        ok = (os.environ.get("ASTRAI_NATIVE", "1") != "0" and any(f in flags for f in BF16_CPU_FLAGS)
              and {"avx512f", "avx512bw", "avx512vl"} <= flags)
        if ok:
            from astrai.kernels.cpu_build import built

            ok = built()
        _STATE["ready"] = ok
    return _STATE["ready"]


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether causal_attention runs for these [S, H, D] inputs (see the module docstring)."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.bfloat16
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and not torch.compiler.is_compiling() and _ready())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [S, H, D] with heads D apart and elements contiguous (rows may be further apart), as the kernel reads."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


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
    """Causal attention of one sequence, q [S, Hq, D], k/v [S, Hkv, D] bf16 -> [S, Hq, D]; `usable` first."""
    return _CausalAttention.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else float(scale))
