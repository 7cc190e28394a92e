"""The decoder: Llama-style (RMSNorm, RoPE, SwiGLU, grouped-query attention), optionally Mixtral MoE.

Parameter names are Hugging Face's (model.embed_tokens, model.layers.{i}.self_attn.q_proj, ...,
model.layers.{i}.block_sparse_moe.experts.{e}.w1 for MoE, lm_head), so `state_dict()` is a
LlamaForCausalLM / MixtralForCausalLM checkpoint as it is written on disk. Each op follows HF's
numerics (RMSNorm in float32, routing softmax in float32, top-k weights renormalised), so
logits match transformers to float32 rounding.

The model sees flattened tokens: `forward(input_ids [T], position_ids [T], ctx) -> hidden [T, H]`;
attention is delegated to `ctx` (astrai.model.attention). `logits(hidden)` is separate so a loss
can run the LM head in chunks and never hold [T, vocab]. With `return_aux=True`, forward also
returns the MoE load-balancing loss (unweighted, Switch/Mixtral formula over all layers' tokens;
None for a dense model); the caller weights it with `config.router_aux_loss_coef`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from astrai.model import torch_floor  # noqa: F401  (refuses an older torch, with the fix)
from astrai.model.attention import AttentionContext
from astrai.model.config import ModelConfig
from astrai.model.rope import Rotary


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What norms, softmaxes and losses accumulate in: float32, or float64 in a float64 run (exactness checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(acc_dtype(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = at_least_float32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.hq * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, c.hidden_size, bias=False)

    def forward(self, x, position_ids, ctx: AttentionContext, rope: Rotary):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.hq, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        q, k = ctx.rotary(q, k, position_ids, rope)
        o = ctx.attend(self.layer_idx, q, k, v)
        return self.o_proj(o.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One Mixtral expert: w1 = gate, w3 = up, w2 = down (Mixtral's checkpoint names)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.w2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.w3 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routed experts. Returns (output, router_logits [T, E]) for the load-balancing loss."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.top_k, self.n = c.num_experts_per_tok, c.num_local_experts
        self.gate = nn.Linear(c.hidden_size, self.n, bias=False)
        self.experts = nn.ModuleList(Expert(c) for _ in range(self.n))

    def forward(self, x):
        logits = self.gate(x)
        probs = torch.softmax(at_least_float32(logits), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)  # renormalised over the chosen experts
        out = torch.zeros_like(x)
        # one matmul per expert over the tokens routed to it (grouped, not one per token)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0 and not self.training:
                continue
            y = expert(x[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out, logits


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(c, layer_idx)
        if c.is_moe:
            self.block_sparse_moe = SparseMoE(c)
        else:
            self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, position_ids, ctx, rope):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, ctx, rope)
        h = self.post_attention_layernorm(x)
        if hasattr(self, "mlp"):
            return x + self.mlp(h), None
        y, router_logits = self.block_sparse_moe(h)
        return x + y, router_logits


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = Rotary(config)
        self.gradient_checkpointing = False  # recompute each layer in backward (activation memory ~ 1 layer)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self):
        """HF's init: normal(0, initializer_range) for linear and embedding weights, norms at 1."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext,
                return_aux: bool = False):
        x = self.model.embed_tokens(input_ids)
        router_logits = []
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x, r = checkpoint(layer, x, position_ids, ctx, self.rope, use_reentrant=False)
            else:
                x, r = layer(x, position_ids, ctx, self.rope)
            if r is not None:
                router_logits.append(r)
        hidden = self.model.norm(x)
        if not return_aux:
            return hidden
        return hidden, (load_balancing_loss(router_logits, self.config) if router_logits else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def load_balancing_loss(router_logits: list[torch.Tensor], c: ModelConfig) -> torch.Tensor:
    """Switch-Transformer load balancing over every layer's tokens: E * sum_e f_e * P_e, where f_e
    is the share of top-k assignments that went to expert e and P_e its mean router probability."""
    logits = at_least_float32(torch.cat(router_logits, dim=0))
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, c.num_experts_per_tok, dim=-1)
    counts = F.one_hot(chosen, c.num_local_experts).to(logits.dtype).sum(dim=(0, 1))
    share = counts / logits.shape[0]
    return c.num_local_experts * torch.sum(share * probs.mean(0))
