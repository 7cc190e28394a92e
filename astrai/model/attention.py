"""The attention context protocol: how a layer's attention is computed is the caller's business.

The model works on flattened tokens (input_ids [T], position_ids [T]). Each attention layer
computes q [T, Hq, D] and k, v [T, Hkv, D], then calls

    q, k = ctx.rotary(q, k, position_ids, rope)     # default: torch apply_rotary on float32 tables
    o = ctx.attend(layer_idx, q, k, v, window=..., scale=...)   # -> [T, Hq, D]

so one model serves training (a document-isolating context over cu_seqlens, astrai.train.packed_attention)
and generation (a KV-cache context, astrai.infer), and a backend may override `rotary` with a fused
kernel. Grouped-query attention is the context's job too: k/v arrive with Hkv heads, unrepeated.

Every context honours the layer's two attention settings:
- `window`: None for full causal attention, or a sliding window W: the query at sequence index i
  sees keys at indices i - W + 1 .. i (itself and the W - 1 before it; Hugging Face's
  `kv_idx > q_idx - sliding_window`). Indices count from the start of the query's document.
- `scale`: the softmax scale (1/sqrt(head_dim) for most families; Gemma 3's query_pre_attn_scalar).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from astrai.model import cpu_ops
from astrai.model import torch_floor  # noqa: F401  (refuses an older torch, with the fix)
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

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
        raise NotImplementedError


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: key visible to query (causal, and inside the window when one is set)."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


def banded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_first: int, k_first: int, window: int,
                scale: Optional[float] = None) -> torch.Tensor:
    """Sliding-window causal attention, 4-D: q [1, Hq, n, D] at positions q_first.., k/v [1, Hkv, m, D]
    at positions k_first.. (the keys end with the last query). Queries go in blocks of `window`, each
    against the keys it can see (its block and the window - 1 before it): O(n * window) work and
    memory, never an n x m mask. Every query sees at least itself, so no row is empty."""
    n, gqa = q.shape[2], q.shape[1] != k.shape[1]
    parts, pos = [], torch.arange(q_first, q_first + n, device=q.device)
    for start in range(0, n, window):
        end = min(start + window, n)
        lo = max(k_first, q_first + start - window + 1)
        hi = q_first + end
        mask = window_mask(pos[start:end], torch.arange(lo, hi, device=q.device), window)
        parts.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, lo - k_first:hi - k_first],
                                                    v[:, :, lo - k_first:hi - k_first], attn_mask=mask, scale=scale,
                                                    enable_gqa=gqa))
    return torch.cat(parts, dim=2)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int] = None,
                scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of one sequence: q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq, D]."""
    # 4-D [1, H, S, D] on purpose: with 3-D inputs torch's CPU SDPA falls back to the math kernel
    # (materialised S x S scores, ~4x slower); 4-D takes the flash kernel, GQA without repeating k/v.
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    if window is not None and window < q.shape[0]:
        return banded_sdpa(q4, k4, v4, 0, 0, window, scale).squeeze(0).transpose(0, 1)
    if cpu_ops.attention_usable(q, k, v):  # bf16 training on a CPU with fast bf16 products: astrai's backward
        return cpu_ops.causal_attention(q, k, v, scale)
    o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)  # not o[0]: its backward would zero-fill a full-size gradient


class CausalContext(AttentionContext):
    """All T tokens are one causal sequence (a single document; the reference in tests)."""

    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        return causal_sdpa(q, k, v, window, scale)
