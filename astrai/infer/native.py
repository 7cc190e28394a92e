"""The CPU engine's own decode-step kernels (astrai/kernels/cpu_gemv.cpp, cpu_decode.cpp), built at first use.

`kernels()` returns the instruction set the kernels run with on this CPU (a `Kernels`), or None where
they cannot run: not x86 with AVX2 and FMA (the flags in /proc/cpuinfo), no C++ compiler, a build that
failed, or `ASTRAI_NATIVE=0` in the environment (`ASTRAI_NATIVE=avx2`: the AVX2 paths only, as an
AVX2-only CPU runs them, for tests and comparisons). Callers then keep torch's products: the kernels are a
speed-up, never a requirement, and nothing computes a different result without them beyond the order of
float32 additions.

- `gemv_bf16(x, w)`: x [M, K] bf16 @ w [N, K]^T bf16 -> [M, N] bf16 (float32 sums, rounded once);
  AVX-512 BF16's VDPBF16PS where the CPU has it, else bf16 widened to float32 under AVX2 + FMA.
- `torch.ops.astrai.gemv_f32(x, w, isa, max_rows)`: float32 x [M, K] @ w [N, K]^T, the float32 projections of
  astrai.infer.native_layer's operator (AVX-512F or AVX2 + FMA).
- `gemv_int8(x, w, scales)`: x [M, K] float32 @ (w [N, K] int8 * scales [N])^T -> [M, N] float32, as
  torch's `_weight_int8pack_mm` (AVX-512F or AVX2).
- `gemv_int4(x, codes, scales, offsets)`: float32 x @ the int4 weights of `int4_layout` (AVX-512F only).
- `torch.ops.astrai.rms_norm_cast(x, w, eps, to_bf16)`: RMSNorm of float32 rows times w, rounded to bf16
  or kept float32: the input of a decode step's projections in one operation (astrai.infer.fused.norm_in).
- `torch.ops.astrai.rope_in_place(x, cos, sin_signed)`: astrai.infer.fused.rope_in_place in one operation.
- `torch.ops.astrai.decode_attention(q, k_cache, v_cache, slots, counts, scale)`: one query per request
  against the K/V at its first counts[b] slots, read in place (the torch backend's decode).

The bf16 product is for the few rows of a decode step (up to GEMV_ROWS): each thread of torch's pool streams
a contiguous range of W's rows once for all rows of x; larger steps (prefill) keep torch's product, whose
blocked kernels (AMX, MKL) reuse each weight over many rows. The int8 and int4 products run at every row
count (torch's weight-only kernels were slower at all of them).

The build (astrai.kernels.cpu_build): once per (sources, torch version) into the user's astrai cache, then
loaded in milliseconds. A failed build is said once on stderr, and the engine goes on with torch's products.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from astrai.kernels.cpu_build import built
from astrai.runtime.hardware import cpu_flags

GEMV_ROWS = 4  # steps of up to this many rows use the kernels (bench/RESULTS.md: level with torch's from ~8)
# instruction sets of the kernels' `isa` argument: AVX2 + FMA, or AVX-512 (bf16: AVX-512 BF16; int8: AVX-512F)
ISA_AVX2, ISA_AVX512 = 1, 2


@dataclass(frozen=True)
class Kernels:
    bf16_isa: int  # ISA_AVX512 (AVX-512 BF16) or ISA_AVX2
    int8_isa: int  # ISA_AVX512 (AVX-512F) or ISA_AVX2
    name: str  # what the machine runs, for logs and benchmarks

    def gemv_bf16(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T; steps of more than GEMV_ROWS rows go to torch's product (inside the operator, so a
        compiled graph needs no branch of its own)."""
        return torch.ops.astrai.gemv_bf16(x.contiguous(), w, self.bf16_isa, GEMV_ROWS)

    def gemv_int8(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.ops.astrai.gemv_int8(x.contiguous(), w, scales, self.int8_isa)

    @property
    def int4(self) -> bool:
        """Whether `gemv_int4` runs here (it needs AVX-512F)."""
        return self.int8_isa == ISA_AVX512

    def gemv_int4(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) \
            -> torch.Tensor:
        """x [M, K] float32 @ W^T for W = scales * q + offsets by groups of 32 input columns (`int4_layout`)."""
        return torch.ops.astrai.gemv_int4(x.contiguous(), codes, scales, offsets)


_STATE: dict = {}  # "kernels": the Kernels or None once decided in this process


def isa_for(flags: Optional[frozenset]) -> Optional[Kernels]:
    """The kernels' instruction sets on a CPU with `flags` (None: not x86 with AVX2 + FMA, or unknown)."""
    if not flags or not {"avx2", "fma"} <= flags:
        return None
    avx512 = {"avx512f", "avx512bw"} <= flags
    bf16 = ISA_AVX512 if avx512 and "avx512_bf16" in flags else ISA_AVX2
    int8 = ISA_AVX512 if avx512 else ISA_AVX2
    return Kernels(bf16, int8, f"bf16 {'avx512_bf16' if bf16 == ISA_AVX512 else 'avx2'}, "
                               f"int8 {'avx512f' if int8 == ISA_AVX512 else 'avx2'}")


def kernels() -> Optional[Kernels]:
    """This CPU's kernels, built or loaded on the first call (see the module docstring), or None."""
    if "kernels" not in _STATE:
        _STATE["kernels"] = _load()
    return _STATE["kernels"]


def _load() -> Optional[Kernels]:
    mode = os.environ.get("ASTRAI_NATIVE", "1")
    if mode == "0":
        return None
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = cpu_flags()
    if mode == "avx2" and flags:  # the AVX2 paths on any CPU that has AVX2 (what an AVX2-only machine runs)
        flags = frozenset(f for f in flags if not f.startswith("avx512"))
    chosen = isa_for(flags)
    if chosen is None:
        return None
    return chosen if built() else None  # a failed build was said on stderr: torch's products instead


class RowsWeight:
    """A packed projection held [out, in] (the layout the kernels stream; for a single projection the
    model's own weight, no copy), multiplied as `product(a, bias)` = a @ W^T (+ bias): by `gemv_bf16` for
    steps of up to GEMV_ROWS rows, by torch (oneDNN) for larger ones. `t` is the [in, out] view, for
    callers that multiply by themselves (the compiled decode)."""

    def __init__(self, w: torch.Tensor, k: Kernels):
        self.w, self.kernels = w, k
        self.shape = (w.shape[1], w.shape[0])

    @property
    def t(self) -> torch.Tensor:
        return self.w.t()

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    def data_ptr(self) -> int:
        return self.w.data_ptr()

    def product(self, a: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if a.dtype == self.w.dtype == torch.bfloat16:
            y = self.kernels.gemv_bf16(a, self.w)
        else:
            y = F.linear(a, self.w)
        return y if bias is None else y.add_(bias)


def rows_weight(ws: list[torch.Tensor], into: Optional[RowsWeight] = None) -> Optional[RowsWeight]:
    """The [out, in] weights `ws` concatenated along out as a RowsWeight (written into `into` when it fits),
    or None unless they are bfloat16 on a CPU whose kernels are built (`kernels()`)."""
    if ws[0].device.type != "cpu" or ws[0].dtype != torch.bfloat16:
        return None
    k = kernels()
    if k is None:
        return None
    if len(ws) == 1 and ws[0].is_contiguous():
        return RowsWeight(ws[0], k)
    shape = (sum(w.shape[0] for w in ws), ws[0].shape[1])
    if isinstance(into, RowsWeight) and tuple(into.w.shape) == shape and into.w.dtype == ws[0].dtype:
        with torch.inference_mode():  # `into` may have been made under it
            return RowsWeight(torch.cat(ws, out=into.w), k)
    return RowsWeight(torch.cat(ws).contiguous(), k)


def int4_layout(codes: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K / 2], scales [N, G], offsets [N, G]) for `gemv_int4`, from astrai.model.quant's int4
    grid (`int4_grid`: codes q [N, K] in 0..15, scales_zeros [G, N, 2], groups of 32 columns): the same codes
    and the same dequantized values w = scale * (q - 8) + zero = scale * q + offset, each group's byte j
    holding q[j] (low nibble) and q[j + 16] (high)."""
    n, k = codes.shape
    g = scales_zeros.shape[0]
    q = codes.to(torch.uint8).view(n, g, 2, k // g // 2)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scale, zero = scales_zeros[..., 0].t().float().contiguous(), scales_zeros[..., 1].t().float().contiguous()
    return packed, scale, (zero - 8 * scale).contiguous()
