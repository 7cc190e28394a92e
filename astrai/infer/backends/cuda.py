"""The `cuda` attention backend: astrai's own CUDA kernels (astrai/kernels) compiled by CuPy.

Fused in-place RoPE, a scatter KV write, ragged paged prefill and split-KV paged decode, all on the
engine's paged cache and AttentionMeta directly (no gather of K/V into a dense copy). Chosen
automatically when CuPy, a CUDA device and a supported dtype (fp16, bf16, fp32) are there and the
model's attention is one the kernels serve (`serves`: head_dim a multiple of 8 up to 256, and a
GQA group x head_dim whose attention block fits the kernels' shared memory; otherwise the torch
backend is chosen before any request, and building this one for such a cache raises
BackendUnavailable with the way out). The kernels take each layer's softmax scale and
sliding window (prefill starts each tile at its first token's window; decode splits cover only a
request's last `window` positions).
"""

from __future__ import annotations

import torch

from astrai.infer.backend import ENV_VAR, AttentionBackend, AttentionMeta, BackendUnavailable
from astrai.kernels.kernel_attention import KernelAttention
from astrai.kernels.launch import ATTN_DTYPES, attention_shape_problem


class CudaBackend(AttentionBackend):
    name = "cuda"

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], executor=None):
        super().__init__(k_cache, v_cache)
        ok, why = _head_dim_served(k_cache[0].shape[-1] if k_cache else 0)
        if not ok:
            raise BackendUnavailable(f"{why}; use {ENV_VAR}=torch")
        if executor is None:
            from astrai.kernels.cupy_exec import CupyExecutor

            executor = CupyExecutor(k_cache[0].device)
        self.ops = KernelAttention(k_cache, v_cache, executor)

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        if torch.device(device).type != "cuda":
            return False, "the cuda backend needs a CUDA device"
        if dtype not in ATTN_DTYPES:
            return False, f"the cuda kernels serve float16, bfloat16 and float32, not {dtype}"
        try:
            import cupy  # noqa: F401
        except ImportError:
            return False, "CuPy is not installed (pip install 'astrai[cuda]')"
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        return True, ""

    @classmethod
    def serves(cls, config) -> tuple[bool, str]:
        problem = attention_shape_problem(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        return problem is None, problem or ""

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope):
        return self.ops.rotary(q, k, positions, rope)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.ops.write_kv(layer, k, v, slots)

    def prefill(self, layer: int, q: torch.Tensor, meta: AttentionMeta, window=None, scale=None) -> torch.Tensor:
        return self.ops.prefill(layer, q, meta, window, scale)

    def decode(self, layer: int, q: torch.Tensor, meta: AttentionMeta, window=None, scale=None) -> torch.Tensor:
        return self.ops.decode(layer, q, meta, window, scale)


def _head_dim_served(head_dim: int) -> tuple[bool, str]:
    if head_dim % 8 or not 0 < head_dim <= 256:
        return False, f"the cuda kernels serve head_dim multiples of 8 up to 256, not {head_dim}"
    return True, ""
