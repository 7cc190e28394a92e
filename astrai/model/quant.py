"""Weight-only quantized linear layers, on torchao: NF4 (QLoRA's frozen base), int8 per channel, int4 by group.

`quantize_linear(linear, kind, name)` turns one nn.Linear into a module whose forward is
`dequantize() @ x (+ bias)`, the bias kept in full precision:

- nf4:  QLoRA's 4-bit NormalFloat (Dettmers et al. 2023) through torchao's `to_nf4`: blocks of 64
        weights share an absmax scale; the scales are double-quantized to int8 in groups of 256
        around their mean (or of the largest divisor of the block count below 256 when 256 does not
        divide it: torchao needs whole groups). About 0.52 bytes per weight. The forward dequantizes
        per call, in the forward and again in the backward, in the input's dtype, on any device.
- int8: symmetric per output channel (scale = absmax / 127.5, torchao's symmetric mapping), torch's `_weight_int8pack_mm` on CPU.
- int4: asymmetric per group of `group_size` input columns (tinygemm's scale and float zero point,
        torchao's `groupwise_affine_quantize_tensor`), torch's `_weight_int4pack_mm_for_cpu` on CPU.

Off CPU, int8 and int4 multiply by the dequantized weight (correct, not fast). A layer whose input
dimension does not divide the block (nf4) or group (int4) size is refused with its name and size;
`quantize_layers` takes the decoder projections only: embeddings and the LM head stay as they are.
`quantize_weight` makes the same layer from a weight read from a checkpoint, without an nn.Linear
(astrai.model.hf_checkpoint quantizes each projection as it reads it), after `check_quantizable`
has checked every size from the headers alone.

A quantized layer's codes never change: `Module.to(dtype)` moves them between devices but does not
dequantize them (an NF4 tensor's own `.to(dtype)` would).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("nf4", "int8", "int4")
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
INT4_GROUP = 64


class QuantError(ValueError):
    """A layer that cannot be quantized as asked (the message names the layer and the size)."""


@contextmanager
def quiet_torchao() -> Iterator[None]:
    """torchao logs a warning per CUDA extension it cannot load on a CPU-only torch (none is used here)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao():
    try:
        with quiet_torchao():
            import torchao.quantization as tq
            import torchao.quantization.utils as tu
    except ImportError as e:
        raise QuantError(f"quantized weights need torchao (pip install --no-deps torchao==0.18.0): {e}") from None
    return tq, tu


def is_nf4(t) -> bool:
    mod = sys.modules.get("torchao.quantization")  # no NF4 tensor exists before torchao is imported
    return mod is not None and isinstance(t, mod.NF4Tensor)


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`'s values: an NF4 tensor dequantized in its own dtype, others as they are."""
    return nf4_dequantize(t) if is_nf4(t) else t


def nf4_scaler_block(n_blocks: int) -> int:
    return max(d for d in range(1, NF4_SCALER_BLOCK + 1) if n_blocks % d == 0)


class QuantizedLinear(nn.Module):
    """What every quantized layer has: its sizes, an optional frozen full-precision bias,
    `dequantize()` and `quantized_bytes()` (the storage of its codes and scales)."""

    kind = ""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def quantized_bytes(self) -> int:
        out = 0
        for b in self.buffers(recurse=False):
            parts = [getattr(b, n) for n in b.__tensor_flatten__()[0]] if is_nf4(b) else [b]
            out += sum(t.numel() * t.element_size() for t in parts)
        return out

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


class NF4Linear(QuantizedLinear):
    kind = "nf4"

    def __init__(self, linear: nn.Linear, name: str):
        super().__init__(linear)
        _check_divides(name, linear.in_features, NF4_BLOCK, "nf4 block")
        self.register_buffer("weight", to_nf4(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _NF4Matmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        return nf4_dequantize(self.weight)

    def _apply(self, fn, recurse=True):
        # a dtype change would dequantize the NF4 tensor (its .to(dtype) does): keep the codes, follow the device
        w = self._buffers.pop("weight")
        try:
            super()._apply(fn, recurse)
            where = fn(torch.empty(0, device=w.device)).device
        finally:
            self._buffers["weight"] = w
        if where != w.device:
            self._buffers["weight"] = w.to(where)
        return self


class _NF4Matmul(torch.autograd.Function):
    """x @ W.T with W dequantized in the forward and again in the backward (as torchao's linear_nf4 does):
    no full-precision copy of a frozen weight lives between the two, which is QLoRA's memory saving."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantize().to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.layer.dequantize().to(grad.dtype), None


def to_nf4(w: torch.Tensor) -> torch.Tensor:
    """`w` as torchao's NF4Tensor, the codes and double-quantized scales torchao's `to_nf4` computes: the
    nearest code of each weight over its block's absmax, found by bisection on the midpoints of the
    code book (one pass instead of torchao's distance to all 16 codes; timed in bench/qlora.py
    --kernels; ties, of measure zero, go to the lower code as in torchao)."""
    _torchao()
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    w = w.contiguous()
    n_blocks = w.numel() // NF4_BLOCK
    scaler_block = nf4_scaler_block(n_blocks)
    scalers, factor, mean = NF4Tensor.double_quantize_scalers(w.flatten(), NF4_BLOCK, scaler_block)
    book = torch.tensor(NF4_CODE_BOOK, dtype=w.dtype, device=w.device)
    blocks = w.view(n_blocks, NF4_BLOCK)
    codes = torch.bucketize(blocks / blocks.abs().amax(1, keepdim=True), (book[1:] + book[:-1]) / 2)
    data = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).flatten()
    meta = SubclassTensorArgs(w.size(), w.stride(), w.storage_offset(), w.dtype, w.device, False)
    return NF4Tensor(meta, NF4_BLOCK, n_blocks, scaler_block, scalers, factor, mean, data, book)


def nf4_dequantize(t) -> torch.Tensor:
    """An NF4Tensor's values, as torchao's `get_original_weight` gives them, through a 256-entry table of
    byte -> (high code, low code) values and one gather (instead of two int64 code tensors and two
    lookups; timed in bench/qlora.py --kernels)."""
    scales = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
    byte = torch.arange(256, device=t.nf4.device)
    pairs = torch.stack([t.nf4[byte >> 4], t.nf4[byte & 15]], -1)
    values = torch.index_select(pairs, 0, t.quantized_data.int()).view(-1, t.block_size)
    return values.mul_(scales[:, None]).view(t.shape)


# the NF4 code book: the 16 quantiles of N(0, 1) scaled to [-1, 1] (QLoRA, appendix E; torchao's values)
NF4_CODE_BOOK = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                 0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)


class Int8Linear(QuantizedLinear):
    kind = "int8"

    def __init__(self, linear: nn.Linear, name: str):
        super().__init__(linear)
        _, tu = _torchao()
        q, scales, _ = tu.dynamically_quantize_per_channel(linear.weight.detach().float(), -128, 127, torch.int8)
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scales", scales.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8, self.scales.to(x.dtype))
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.weight_int8.float() * self.scales.float()[:, None]).to(self.scales.dtype)


class Int4Linear(QuantizedLinear):
    kind = "int4"

    def __init__(self, linear: nn.Linear, name: str, group_size: int = INT4_GROUP, grid=None):
        """`grid`: `int4_grid(linear.weight, group_size, name)` when the caller made it already."""
        super().__init__(linear)
        w = linear.weight.detach()
        self.group_size = group_size
        codes, scales_zeros = int4_grid(w, group_size, name) if grid is None else grid
        self.register_buffer("codes", torch._convert_weight_to_int4pack_for_cpu(codes, 1).to(w.device))
        self.register_buffer("scales_zeros", scales_zeros.to(device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.codes, self.group_size,
                                                  self.scales_zeros.to(x.dtype))
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        # the kernel's own reading of the packed codes: the identity times the weight is its transpose
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        w = torch._weight_int4pack_mm_for_cpu(eye, self.codes.cpu(), self.group_size, self.scales_zeros.cpu())
        return w.T.contiguous().to(self.codes.device)


def int4_grid(w: torch.Tensor, group_size: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in] in 0..15, scales_zeros [in / group_size, out, 2] float32) of w [out, in] quantized
    as int4 (torchao's `groupwise_affine_quantize_tensor`: w ~ scale * (q - 8) + zero); a shape the CPU
    packing cannot hold is refused naming `name` (QuantError)."""
    _check_shape(name, tuple(w.shape), "int4", group_size)
    _, tu = _torchao()
    return tu.groupwise_affine_quantize_tensor(w.detach().float().cpu(), 4, group_size, torch.float32)


def _check_divides(name: str, size: int, unit: int, what: str):
    if size % unit:
        raise QuantError(f"{name}: input dimension {size} is not a multiple of the {what} size {unit}, so this "
                         f"layer cannot be quantized so")


# torch's CPU int4 packing (_convert_weight_to_int4pack_for_cpu) takes output sizes in tiles of 16 rows
INT4_OUT_TILE = 16


def _check_shape(name: str, shape: tuple, kind: str, group_size: int = INT4_GROUP):
    """Refuse (QuantError naming `name`) an [out, in] weight `kind` cannot hold: an input size that does not
    divide the nf4 block or int4 group, an int4 output size that is not a multiple of INT4_OUT_TILE."""
    unit = {"nf4": (NF4_BLOCK, "nf4 block"), "int4": (group_size, "int4 group")}.get(kind)
    if unit:
        _check_divides(name, shape[1], *unit)
    if kind == "int4" and shape[0] % INT4_OUT_TILE:
        raise QuantError(f"{name}: output dimension {shape[0]} is not a multiple of {INT4_OUT_TILE} (torch's int4 "
                         f"packing on the CPU), so this layer cannot be quantized to int4; int8 can")


def quantize_linear(linear: nn.Linear, kind: str, name: str = "linear", group_size: int = INT4_GROUP) \
        -> QuantizedLinear:
    """`linear` as a frozen quantized layer of `kind` (nf4, int8, int4); `name` is used in errors."""
    if kind == "nf4":
        return NF4Linear(linear, name)
    if kind == "int8":
        return Int8Linear(linear, name)
    if kind == "int4":
        return Int4Linear(linear, name, group_size)
    raise QuantError(f"{name}: unknown quantization {kind!r}; choose one of {', '.join(KINDS)}")


def quantize_weight(weight: torch.Tensor, bias: Optional[torch.Tensor], kind: str, name: str,
                    group_size: int = INT4_GROUP) -> QuantizedLinear:
    """The quantized layer of a [out, in] `weight` (and `bias`) read from a checkpoint: what quantize_linear
    makes of an nn.Linear holding them, without building one (the model loader quantizes each projection as
    it reads it, so no full-precision layer is ever allocated)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return quantize_linear(linear, kind, name, group_size)


def bytes_per_weight(kind: str, item: int) -> float:
    """About how many bytes a weight takes once quantized (`item`: bytes of the full-precision dtype):
    nf4 half a byte plus an int8 scale per block, int8 one byte (a scale per row aside), int4 half a
    byte plus a scale and a zero point per group."""
    return {"nf4": 0.5 + 1 / NF4_BLOCK, "int8": 1.0, "int4": 0.5 + 2 * item / INT4_GROUP}[kind]


def check_quantizable(shapes: dict[str, tuple], kind: str, group_size: int = INT4_GROUP):
    """Refuse, naming the first, a [out, in] weight (name -> shape) whose input size does not divide the
    block (nf4) or group (int4) size, or whose output size int4 cannot pack (`_check_shape`): checked on
    shapes alone, before any tensor is read."""
    if kind not in KINDS:
        raise QuantError(f"unknown quantization {kind!r}; choose one of {', '.join(KINDS)}")
    for name, shape in shapes.items():
        _check_shape(name.removesuffix(".weight"), tuple(shape), kind, group_size)


def quantize_layers(model: nn.Module, kind: str, names: tuple[str, ...], group_size: int = INT4_GROUP,
                    under: Optional[nn.Module] = None) -> list[str]:
    """Replace, in place, every nn.Linear under `under` (default: the decoder layers, model.model.layers)
    whose own name is in `names`. Every layer is checked before any is replaced. Returns their names."""
    root = under if under is not None else model.model.layers
    prefix = next((n for n, m in model.named_modules() if m is root), "")
    found = [(".".join(p for p in (prefix, n, child_name) if p), parent, child_name, child)
             for n, parent in root.named_modules() for child_name, child in parent.named_children()
             if child_name in names and isinstance(child, nn.Linear)]
    for full, _, _, child in found:
        _check_shape(full, (child.out_features, child.in_features), kind, group_size)
    for full, parent, child_name, child in found:
        setattr(parent, child_name, quantize_linear(child, kind, full, group_size))
    return [f[0] for f in found]


def quantized_bytes(model: nn.Module) -> int:
    """The storage of every quantized layer's codes and scales in `model`."""
    return sum(m.quantized_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))
