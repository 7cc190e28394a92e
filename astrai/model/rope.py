"""Rotary position embeddings (RoPE), the same numbers as Hugging Face's Llama.

`inv_freq(config)` gives the inverse frequencies with the scaling HF calls "default", "linear"
(positions divided by a factor) and "llama3" (low frequencies divided by the factor, high ones
kept, a smooth ramp between). `Rotary` holds a float32 cos/sin table indexed by position id, grown
on demand; the table is computed as HF computes cos/sin on the fly (float32 position x inv_freq),
so gathering from it gives bit-identical values. `apply_rotary` uses HF's half-split layout
(rotate_half), not the interleaved pairs of the original paper: checkpoints stay interchangeable.
"""

from __future__ import annotations

import math

import torch

from astrai.model.config import ModelConfig


def inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(freq, scaling)
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")
    return freq


def _llama3(freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    # long wavelengths (beyond the original context) are stretched by the factor, short ones kept
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables [positions, head_dim] in float32, shared by every layer of a model.

    Not an nn.Module buffer on purpose: `model.to(torch.bfloat16)` must not round the table (HF
    keeps rotary math in float32 too); the table follows the device of the positions it is asked for.
    """

    def __init__(self, config: ModelConfig):
        self.inv_freq = inv_freq(config)
        self._cos = self._sin = torch.empty(0, config.head_dim)
        self._grow(config.max_position_embeddings, torch.device("cpu"))

    def _grow(self, n: int, device: torch.device):
        pos = torch.arange(n, dtype=torch.int64, device=device).float()
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] (float32) for flat position ids [T]."""
        if self._cos.device != position_ids.device:
            self._grow(self._cos.shape[0], position_ids.device)
        if not torch.compiler.is_compiling():
            top = int(position_ids.max()) + 1 if position_ids.numel() else 0
            if top > self._cos.shape[0]:
                self._grow(max(top, 2 * self._cos.shape[0]), position_ids.device)
        return self._cos[position_ids], self._sin[position_ids]

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 tables (for fused kernels that index them by position themselves)."""
        if self._cos.device != device:
            self._grow(self._cos.shape[0], device)
        return self._cos, self._sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Rotate(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin, whose backward is the transposed rotation: g * cos +
    rotate_half^T(g * sin), rotate_half^T(y1, y2) = (y2, -y1). Autograd through the two half-slices
    of rotate_half would allocate and zero-fill a full-size gradient per slice (4 per layer: 7% of
    a 4-layer SmolLM2-shaped training step, bench/finetune.py); this computes the same numbers
    without them."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        gs = g * sin
        half = g.shape[-1] // 2
        return g * cos + torch.cat((gs[..., half:], -gs[..., :half]), dim=-1), None, None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> rotated q, k in their own dtype (as HF)."""
    cos = cos[:, None, :].to(q.dtype)
    sin = sin[:, None, :].to(q.dtype)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotate.apply(q, cos, sin), _Rotate.apply(k, cos, sin)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
