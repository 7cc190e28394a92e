"""Rotary position embeddings (RoPE), the same numbers as Hugging Face's.

`rope_frequencies(head_dim, theta, scaling, max_positions)` gives the inverse frequencies and the
cos/sin factor for the scalings HF calls "default", "linear" (positions divided by a factor),
"llama3" (low frequencies divided by the factor, high ones kept, a smooth ramp between) and "yarn"
(a ramp between interpolated and extrapolated frequencies by rotation count, and cos/sin scaled by
an attention factor). `Rotary` holds a float32 cos/sin table indexed by position id, grown on
demand; the table is computed as HF computes cos/sin on the fly (float32 position x inv_freq, then
times the attention factor), so gathering from it gives bit-identical values. `apply_rotary` uses
HF's half-split layout (rotate_half), not the interleaved pairs of the original paper: checkpoints
stay interchangeable. A model holds one Rotary per distinct RoPE (Gemma 3's local layers have their
own base).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from astrai.model import cpu_ops

# positions tabled up front; more are added on demand (a 128k-context config does not cost 128k rows)
INITIAL_POSITIONS = 4096


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[dict],
                     max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention factor applied to cos and sin)."""
    dim = head_dim
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_positions)
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3, yarn)")
    return freq, 1.0


def inv_freq(config) -> torch.Tensor:
    """The global (full-attention layers') inverse frequencies of a ModelConfig."""
    return rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)[0]


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


def _yarn(dim: int, theta: float, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of each dimension taken from the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention


class Rotary:
    """cos/sin tables [positions, head_dim] in float32.

    Not an nn.Module buffer on purpose: `model.to(torch.bfloat16)` must not round the table (HF
    keeps rotary math in float32 too); the table follows the device of the positions it is asked for.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], max_positions: int):
        self.inv_freq, self.attention_factor = rope_frequencies(head_dim, theta, scaling, max_positions)
        self._cos = self._sin = torch.empty(0, head_dim)
        self._grow(min(max_positions, INITIAL_POSITIONS), torch.device("cpu"))

    def _grow(self, n: int, device: torch.device):
        pos = torch.arange(n, dtype=torch.int64, device=device).float()
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor

    def reserve(self, n: int):
        """Table at least n positions now (fused kernels index the table without a bounds check)."""
        if n > self._cos.shape[0]:
            self._grow(n, self._cos.device)

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
    if cpu_ops.rotary_usable(q, cos) and k.dtype == q.dtype:  # one pass each way, torch's bits (AVX-512 CPUs)
        cos, sin = cos.to(q.dtype).contiguous(), sin.to(q.dtype).contiguous()
        return cpu_ops.rotary(q, cos, sin), cpu_ops.rotary(k, cos, sin)
    cos = cos[:, None, :].to(q.dtype)
    sin = sin[:, None, :].to(q.dtype)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotate.apply(q, cos, sin), _Rotate.apply(k, cos, sin)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
