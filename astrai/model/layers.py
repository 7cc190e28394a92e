"""The decoder's building blocks, each with Hugging Face's numerics and parameter names.

- RMSNorm: Llama's (normalise in float32, cast back, times w) or Gemma's (normalise and multiply by
  1 + w, all in float32, then cast back; weights start at 0).
- Attention: q/k/v/o projections (biases as the family has them), optional RMSNorm over head_dim
  on q and k (Qwen3, Gemma 3) before RoPE, then `ctx.rotary` and `ctx.attend` with the layer's
  sliding window and softmax scale (astrai.model.attention).
- MLP: the gated MLP down(act(gate(x)) * up(x)), act = SiLU (SwiGLU), GELU-tanh (Gemma) or GELU.
- SparseMoE: a softmax top-k router in float32 (weights renormalised over the chosen experts in
  Mixtral, optionally in Qwen3-MoE, where they are also cast back to the logits' dtype as HF does)
  and one grouped matmul per expert over the tokens routed to it. Experts are Mixtral's w1/w2/w3 or
  Qwen3-MoE's gate/up/down_proj (the names on disk). Returns (output, router_logits [T, E]).

Projections stay plain nn.Linear modules under the names PEFT targets (q_proj ... down_proj), so
adapters can wrap them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from astrai.model import cpu_ops
from astrai.model.attention import AttentionContext
from astrai.model.casts import shared_input
from astrai.model.config import ModelConfig
from astrai.model.rope import Rotary


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What norms, softmaxes and losses accumulate in: float32, or float64 in a float64 run (exactness checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(acc_dtype(x.dtype))


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"activation {name!r} is not modelled")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: bool = False):
        super().__init__()
        self.offset = offset  # Gemma: scale by (1 + weight), weight initialised at 0
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset and cpu_ops.rms_norm_usable(x, self.weight):  # one pass each way (AVX-512 CPUs)
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = at_least_float32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.to(h.dtype))).to(dtype)
        return self.weight * h.to(dtype)

    @torch.no_grad()
    def reset_parameters(self):
        self.weight.fill_(0.0 if self.offset else 1.0)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv_bias = c.traits.qkv_bias or c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.hq * self.d, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.hq * self.d, c.hidden_size, bias=c.attention_bias)
        if c.traits.qk_norm:
            self.q_norm = RMSNorm(self.d, c.rms_norm_eps, offset=c.traits.gemma)
            self.k_norm = RMSNorm(self.d, c.rms_norm_eps, offset=c.traits.gemma)
        self.window = c.layer_window(layer_idx)
        self.scale = c.softmax_scale

    def forward(self, x, position_ids, ctx: AttentionContext, rope: Rotary):
        t = x.shape[0]
        x = shared_input(x)  # under autocast: cast once for q, k and v
        q = self.q_proj(x).view(t, self.hq, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ctx.rotary(q, k, position_ids, rope)
        o = ctx.attend(self.layer_idx, q, k, v, window=self.window, scale=self.scale)
        return self.o_proj(o.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        x = shared_input(x)  # under autocast: cast once for gate and up
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.act is F.silu and cpu_ops.swiglu_usable(g, u):  # training on CPU: one pass each way
            return self.down_proj(cpu_ops.swiglu(g, u))
        return self.down_proj(self.act(g) * u)


class Expert(nn.Module):
    """One Mixtral expert: w1 = gate, w3 = up, w2 = down (Mixtral's checkpoint names)."""

    def __init__(self, hidden: int, inner: int, act: str):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.act = activation(act)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routed experts. Returns (output, router_logits [T, E]) for the load-balancing loss."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.top_k, self.n = c.num_experts_per_tok, c.num_local_experts
        self.mixtral = c.traits.moe == "mixtral"
        self.renormalise = self.mixtral or c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, self.n, bias=False)
        h, inner = c.hidden_size, c.expert_size
        self.experts = nn.ModuleList(Expert(h, inner, c.hidden_act) if self.mixtral else MLP(h, inner, c.hidden_act)
                                     for _ in range(self.n))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [T, E], weights [T, k], chosen experts [T, k])."""
        logits = self.gate(x)
        return (logits, *route(logits, self.top_k, self.renormalise, cast_back=not self.mixtral))

    def forward(self, x):
        logits, weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        # one matmul per expert over the tokens routed to it (grouped, not one per token)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0 and not self.training:
                continue
            y = expert(x[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out, logits


def route(logits: torch.Tensor, top_k: int, renormalise: bool, cast_back: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], chosen experts [T, k]) from router logits [T, E]: softmax in float32, the top k,
    renormalised over them when asked, cast back to the logits' dtype when asked (not in Mixtral)."""
    probs = torch.softmax(at_least_float32(logits), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    if cast_back:
        weights = weights.to(logits.dtype)
    return weights, chosen


def embed_scale(c: ModelConfig, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Gemma multiplies embeddings by sqrt(hidden_size), held in float32 and rounded to the activation dtype."""
    if not c.traits.gemma:
        return None
    return torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
