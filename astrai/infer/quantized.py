"""Quantized projection weights of the engine's fused forward (`EngineOptions.quantize`: int8 | int4).

`quantize_weight(parts, kind, name)` turns a packed projection (the (weight [out, in], bias) pairs
astrai.infer.packed concatenates: q/k/v, gate/up, o, down, optionally the LM head) into a
`QuantizedWeight` whose `product(a, bias)` is the fused forward's a [T, in] @ W (+ bias), at any number
of rows (decode, a batch of decodes, a prefill chunk). The weight formats are astrai.model.quant's:

- int8: symmetric per output channel (torchao's `dynamically_quantize_per_channel`, quant.Int8Linear's
        codes and scales), multiplied by fbgemm's dynamic int8 linear
        (`torch.ops.quantized.linear_dynamic`): each call quantizes its activations to unsigned 7 bits with
        one scale and zero point over the whole input (`reduce_range`: on a CPU without VNNI, AVX2's
        u8 x s8 pair sums saturate int16 at 8 bits), multiplies in int32, and scales back by the two
        scales in float32. A step's rows share that activation scale.
- int4: asymmetric by groups of quant.INT4_GROUP input columns (quant.Int4Linear: torchao's
        `groupwise_affine_quantize_tensor`, a float scale and zero point per group and channel),
        multiplied by torch's `_weight_int4pack_mm_for_cpu` (float32 activations, the weight
        dequantized per tile). A dimension that does not divide the group is refused, naming the
        tensor and the size.

Why these kernels: they were the fastest per format on SmolLM2's projections at 1 and 16 rows on a
2-thread AVX2 CPU (bench/quant_kernels.py; figures in bench/RESULTS.md). For int8, fbgemm's dynamic
linear beat the float32 products split over the threads (astrai.infer.fused.matmul) and every torchao
0.18 int8 configuration on CPU (weight-only runs `_weight_int8pack_mm`, several times slower than
float32 at one row; dynamic activation runs its own quantize and `_int_mm`). For int4 no kernel shipped
for this CPU beats float32 (torchao's x86 low-bit kernels are not in its wheel; its Int4WeightOnly on
CPU is the same `_weight_int4pack_mm_for_cpu`): int4 here saves memory, not time.

fbgemm's weight is a torch.ao quantized tensor (qint8, per channel): torch marks the creation of such
tensors as deprecated, with a warning at each; they are only made here, at pack time, so that warning
is silenced around the one call (`_per_channel_qint8`).

Only the CPU engine in float32 runs quantized weights (`check_engine`): both kernels take float32
activations on the CPU.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.nn as nn

from astrai.model import quant

KINDS = ("int8", "int4")


class QuantizedWeight:
    """A packed projection [in, out] in `kind`: `product(a, bias)` = a @ W (+ bias); `dequantize()` the
    [in, out] float values the product multiplies by."""

    kind = ""

    def __init__(self, layer: quant.QuantizedLinear):
        self.layer = layer  # astrai.model.quant's layer: the codes and scales
        self.shape = (layer.in_features, layer.out_features)

    def product(self, a: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        return self.layer.dequantize().float().t()

    def nbytes(self) -> int:
        return self.layer.quantized_bytes()


class Int8Weight(QuantizedWeight):
    kind = "int8"

    def __init__(self, layer: quant.Int8Linear):
        super().__init__(layer)
        self.packed = torch.ops.quantized.linear_prepack(_per_channel_qint8(layer.weight_int8, layer.scales), None)

    def product(self, a, bias=None):
        y = torch.ops.quantized.linear_dynamic(a, self.packed, True)  # reduce_range: see the module docstring
        return y if bias is None else y.add_(bias)


class Int4Weight(QuantizedWeight):
    kind = "int4"

    def product(self, a, bias=None):
        y = self.layer(a)  # quant.Int4Linear: _weight_int4pack_mm_for_cpu
        return y if bias is None else y.add_(bias)


def _per_channel_qint8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's deprecation of quantized tensors (see the module docstring)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return torch._make_per_channel_quantized_tensor(codes, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)


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
        return Int4Weight(quant.Int4Linear(shell, name))
    raise quant.QuantError(f"{name}: unknown quantization {kind!r}; choose one of {', '.join(KINDS)}")


def check_engine(kind: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses (ValueError, one line) an engine that cannot run `kind` weights: not the CPU, not float32."""
    if device.type != "cpu":
        raise ValueError(f"quantize {kind}: quantized weights run on the CPU engine only (device {device}); "
                         f"drop --quantize to run on {device}")
    if dtype != torch.float32:
        raise ValueError(f"quantize {kind}: quantized weights multiply float32 activations; use --dtype float32 "
                         f"(or auto), not {str(dtype).replace('torch.', '')}")
