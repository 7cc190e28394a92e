"""The decoder of every family (astrai.model.config): layers from astrai.model.layers, stacked.

Parameter names are Hugging Face's (model.embed_tokens, model.layers.{i}.self_attn.q_proj, ...,
model.layers.{i}.block_sparse_moe.experts.{e}.w1 for Mixtral, model.layers.{i}.mlp.experts.{e}.gate_proj
for Qwen3-MoE, lm_head), so `state_dict()` is the family's checkpoint as it is written on disk.
Each op follows HF's numerics (norms in float32, routing softmax in float32, Gemma's embedding scale
rounded to the activation dtype), so logits match transformers to float32 rounding.

A layer is `x + attn(norm(x))` then `x + mlp(norm(x))`; Gemma also normalises each branch's output
(post_attention_layernorm on the attention output, pre/post_feedforward_layernorm around the MLP).
Sliding layers use the local RoPE when the family has one (Gemma 3), the global one otherwise.

The model sees flattened tokens: `forward(input_ids [T], position_ids [T], ctx) -> hidden [T, H]`;
attention is delegated to `ctx` (astrai.model.attention). `logits(hidden)` is separate so a loss
can run the LM head in chunks and never hold [T, vocab]; it applies the final soft-capping when the
config has one (`cap_logits` for a caller that multiplies by the head itself). With
`return_aux=True`, forward also returns the MoE load-balancing loss (unweighted, Switch/Mixtral
formula over all sparse layers' tokens; None for a dense model); the caller weights it with
`config.router_aux_loss_coef`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from astrai.model import torch_floor  # noqa: F401  (refuses an older torch, with the fix)
from astrai.model.attention import AttentionContext
from astrai.model.config import ModelConfig
from astrai.model.layers import MLP, Attention, RMSNorm, SparseMoE, acc_dtype, at_least_float32, embed_scale
from astrai.model.rope import Rotary

__all__ = ["CausalLM", "DecoderLayer", "acc_dtype", "at_least_float32", "load_balancing_loss"]


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer_idx: int):
        super().__init__()
        self.gemma = c.traits.gemma
        self.self_attn = Attention(c, layer_idx)
        if c.is_sparse_layer(layer_idx) and c.traits.moe == "mixtral":
            self.block_sparse_moe = SparseMoE(c)
        elif c.is_sparse_layer(layer_idx):
            self.mlp = SparseMoE(c)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        norm = dict(eps=c.rms_norm_eps, offset=self.gemma)
        self.input_layernorm = RMSNorm(c.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **norm)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, **norm)
            self.post_feedforward_layernorm = RMSNorm(c.hidden_size, **norm)

    def _ffn(self, h):
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return ffn(h) if isinstance(ffn, SparseMoE) else (ffn(h), None)

    def forward(self, x, position_ids, ctx, rope):
        a = self.self_attn(self.input_layernorm(x), position_ids, ctx, rope)
        if self.gemma:
            x = x + self.post_attention_layernorm(a)
            y, router_logits = self._ffn(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(y), router_logits
        x = x + a
        y, router_logits = self._ffn(self.post_attention_layernorm(x))
        return x + y, router_logits


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.traits.gemma)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        local = c.local_rope
        self.rope_local = self.rope if local is None else Rotary(
            c.head_dim, local["rope_theta"], None if local.get("rope_type", "default") == "default" else local,
            c.max_position_embeddings)
        self.layer_ropes = [self.rope_local if c.is_sliding_layer(i) else self.rope for i in range(c.num_hidden_layers)]
        self.gradient_checkpointing = False  # recompute each layer in backward (activation memory ~ 1 layer)
        self.tie_weights()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self):
        """HF's init: normal(0, initializer_range) for linear and embedding weights, zero biases, norms at
        1 (Gemma's (1 + w) norms at 0)."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.reset_parameters()

    def reserve_positions(self, n: int):
        """RoPE tables for positions < n now (for kernels that read the tables without bounds checks)."""
        for rope in {id(r): r for r in self.layer_ropes + [self.rope]}.values():
            rope.reserve(n)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext,
                return_aux: bool = False):
        x = self.model.embed_tokens(input_ids)
        scale = embed_scale(self.config, x.dtype)
        if scale is not None:
            x = x * scale.to(x.device)
        router_logits = []
        for layer, rope in zip(self.model.layers, self.layer_ropes):
            if self.gradient_checkpointing and self.training:
                x, r = checkpoint(layer, x, position_ids, ctx, rope, use_reentrant=False)
            else:
                x, r = layer(x, position_ids, ctx, rope)
            if r is not None:
                router_logits.append(r)
        hidden = self.model.norm(x)
        if not return_aux:
            return hidden
        return hidden, (load_balancing_loss(router_logits, self.config) if router_logits else None)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Final logit soft-capping (Gemma): cap * tanh(logits / cap), as HF orders it; identity without one."""
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(hidden))

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
