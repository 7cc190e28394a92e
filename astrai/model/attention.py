"""The attention context protocol: how a layer's attention is computed is the caller's business.

The model works on flattened tokens (input_ids [T], position_ids [T]). Each attention layer
computes q [T, Hq, D] and k, v [T, Hkv, D], then calls

    q, k = ctx.rotary(q, k, position_ids, rope)     # default: torch apply_rotary on float32 tables
    o = ctx.attend(layer_idx, q, k, v)              # -> [T, Hq, D]

so one model serves training (a document-isolating context over cu_seqlens, astrai.train.packed_attention)
and generation (a KV-cache context, astrai.infer), and a backend may override `rotary` with a fused
kernel. Grouped-query attention is the context's job too: k/v arrive with Hkv heads, unrepeated.
The softmax scale is always 1/sqrt(head_dim) (Llama's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.model.rope import Rotary, apply_rotary


class AttentionContext:
    """Base class: default rotary; subclasses implement `attend`."""

    def rotary(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, rope: Rotary):
        if torch.compiler.is_compiling():
            return apply_rotary(q, k, *rope.cos_sin(position_ids))
        # every layer of a forward passes the same position ids: gather the cos/sin rows once
        cached = getattr(self, "_cos_sin", None)
        if cached is None or cached[0] is not position_ids or cached[1] is not rope:
            cached = self._cos_sin = (position_ids, rope, *rope.cos_sin(position_ids))
        return apply_rotary(q, k, cached[2], cached[3])

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence: q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq, D]."""
    # 4-D [1, H, S, D] on purpose: with 3-D inputs torch's CPU SDPA falls back to the math kernel
    # (materialised S x S scores, ~4x slower); 4-D takes the flash kernel, GQA without repeating k/v.
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)  # not o[0]: its backward would zero-fill a full-size gradient


class CausalContext(AttentionContext):
    """All T tokens are one causal sequence (a single document; the reference in tests)."""

    def attend(self, layer_idx, q, k, v):
        return causal_sdpa(q, k, v)
