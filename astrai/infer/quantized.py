"""Quantized projection weights of the engine's fused forward (`EngineOptions.quantize`: int8 | int4).

`quantize_weight(parts, kind, name)` turns a packed projection (the (weight [out, in], bias) pairs
astrai.infer.packed concatenates: q/k/v, gate/up, o, down, optionally the LM head) into a
`QuantizedWeight` whose `product(a, bias)` is the fused forward's a [T, in] @ W (+ bias), at any number
of rows (decode, a batch of decodes, a prefill chunk). The weight formats are astrai.model.quant's:

- int8: symmetric per output channel, weight-only (quant.Int8Linear: torchao's
        `dynamically_quantize_per_channel`, torch's `_weight_int8pack_mm`, float32 activations).
- int4: asymmetric by groups of INT4_GROUP (32) input columns (quant.Int4Linear: torchao's
        `groupwise_affine_quantize_tensor`), torch's `_weight_int4pack_mm_for_cpu`. A dimension that
        does not divide the group is refused, naming the tensor and the size.

Why weight-only: fbgemm's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`) multiplies faster
than float32 on an AVX2 CPU, but it quantizes each input to 7 bits with one scale over the whole input,
and on SmolLM2 that moved the held-out perplexity far past 1% (activation outliers, worst at down_proj's
input); the weight-only kernels keep float32 activations and meet the bounds. On an AVX2 CPU without
VNNI they are slower than the float32 products: here quantization saves memory, not time (figures in
bench/RESULTS.md).

Only the CPU engine in float32 runs quantized weights (`check_engine`): both kernels take float32
activations on the CPU.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from astrai.infer import native
from astrai.model import quant

KINDS = ("int8", "int4")
# int4 groups of 32 input columns: llama.cpp's Q4_0/Q4_1 block, so a checkpoint made from such a file
# (as the packaged SmolLM2 is) is requantized on its own grid
INT4_GROUP = 32


class QuantizedWeight:
    """A packed projection [in, out] in `kind`: `product(a, bias)` = a @ W (+ bias); `dequantize()` the
    [in, out] float values the product multiplies by."""

    kind = ""

    def __init__(self, layer: quant.QuantizedLinear):
        self.layer = layer  # astrai.model.quant's layer: the codes and scales
        self.shape = (layer.in_features, layer.out_features)

    def product(self, a: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.layer(a)  # quant.Int8Linear: _weight_int8pack_mm; quant.Int4Linear: _weight_int4pack_mm_for_cpu
        return y if bias is None else y.add_(bias)

    def dequantize(self) -> torch.Tensor:
        return self.layer.dequantize().float().t()

    def nbytes(self) -> int:
        return self.layer.quantized_bytes()


class Int8Weight(QuantizedWeight):
    """int8: multiplied by astrai's kernel (astrai.infer.native.gemv_int8, the same sums in another order)
    where it is built, at every row count (10-18x faster than `_weight_int8pack_mm` from 1 to 16 rows, 21x
    at 512: bench/RESULTS.md), else by torch's."""

    kind = "int8"

    def __init__(self, layer: quant.QuantizedLinear):
        super().__init__(layer)
        self.kernels = native.kernels() if layer.weight_int8.device.type == "cpu" else None

    def product(self, a: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.kernels is None or a.dtype != torch.float32 or self.layer.scales.dtype != torch.float32:
            return super().product(a, bias)
        y = self.kernels.gemv_int8(a, self.layer.weight_int8, self.layer.scales)
        return y if bias is None else y.add_(bias)


class Int4Weight(QuantizedWeight):
    """int4: multiplied by astrai's kernel (astrai.infer.native.gemv_int4) on a CPU with AVX-512, from the
    same codes, scales and zeros in a layout of its own (`native.int4_layout`), else by torch's."""

    kind = "int4"

    def __init__(self, layer: quant.QuantizedLinear, grid: tuple[torch.Tensor, torch.Tensor]):
        """`grid`: the layer's codes and scales (quant.int4_grid), quantized once for both layouts."""
        super().__init__(layer)
        k = native.kernels() if layer.codes.device.type == "cpu" else None
        self.kernels, self.packed = (k, native.int4_layout(*grid)) if k and k.int4 else (None, None)

    def product(self, a: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.kernels is None or a.dtype != torch.float32:
            return super().product(a, bias)
        y = self.kernels.gemv_int4(a, *self.packed)
        return y if bias is None else y.add_(bias)


def quantize_weight(parts: Sequence[tuple[torch.Tensor, Optional[torch.Tensor]]], kind: str, name: str) \
        -> QuantizedWeight:
    """The (weight [out, in], bias) pairs' weights, concatenated along out, as a QuantizedWeight of `kind`
    (biases are the caller's: they are added in float32 by `product`). `name` names the tensor in errors
    (a dimension not divisible by the int4 group: quant.QuantError)."""
    w = torch.cat([p[0] for p in parts]).detach().float() if len(parts) > 1 else parts[0][0].detach().float()
    shell = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    shell.weight = nn.Parameter(w, requires_grad=False)
    if kind == "int8":
        return Int8Weight(quant.Int8Linear(shell, name))
    if kind == "int4":
        grid = quant.int4_grid(w, INT4_GROUP, name)
        return Int4Weight(quant.Int4Linear(shell, name, INT4_GROUP, grid), grid)
    raise quant.QuantError(f"{name}: unknown quantization {kind!r}; choose one of {', '.join(KINDS)}")


def check_engine(kind: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses (ValueError, one line) an engine that cannot run `kind` weights: not the CPU, not float32."""
    if device.type != "cpu":
        raise ValueError(f"quantize {kind}: quantized weights run on the CPU engine only (device {device}); "
                         f"drop --quantize to run on {device}")
    if dtype != torch.float32:
        raise ValueError(f"quantize {kind}: quantized weights multiply float32 activations; use --dtype float32 "
                         f"(or auto), not {str(dtype).replace('torch.', '')}")
