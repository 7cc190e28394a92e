"""A dense decoder layer of a CPU decode step as one operator of astrai's kernels (astrai/kernels/cpu_layer.cpp).

A batch-1 decode step of a small model spent about as long between torch's operations (the Python of
astrai.infer.fused's layer, torch's dispatch and allocations: some 30 operations a layer) as streaming the
weights. `torch.ops.astrai.decode_layer` computes the same layer, the same operations rounded as torch rounds
them, in one call: norm, q/k/v product (+ biases), q/k norms, RoPE, the K/V write, attention over each request's
slots, o product and residual (Gemma: its output norm), norm, gate/up product, act(gate) * up, down product and
residual.

`layer_spec(layer, fused)` reads a packed layer (astrai.infer.packed.Layer) into the operator's arguments once
per pack, or None where it does not apply: no kernels on this CPU, a sparse (experts) layer, an activation other
than silu and Gemma's tanh GELU, or projections not all of one kind:

    float32   the model's own [out, in] weights (q, k, v as three parts, gate and up as two; no copy),
              multiplied by astrai's `gemv_f32`
    bf16      the packed RowsWeight's (astrai.infer.native), `gemv_bf16`
    int8      astrai.infer.quantized's Int8Weight: codes and per-row scales, `gemv_int8`
    int4      Int4Weight's kernel layout (AVX-512 only), `gemv_int4`

FusedModel runs the operator for decode steps of up to MAX_ROWS rows without adapters, when the step's
attention is the torch backend's padded plan on a CPU (`PagedContext.native_plan`); everything else keeps the
Python layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from astrai.infer import native
from astrai.infer.native import RowsWeight
from astrai.infer.quantized import Int4Weight, Int8Weight

KIND_F32, KIND_BF16, KIND_INT8, KIND_INT4 = 0, 1, 2, 3
# decode steps of up to this many rows (requests) run the operator; float32 and bf16 products of more than
# GEMV_ROWS rows are torch's inside it
MAX_ROWS = 16
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


@dataclass
class LayerSpec:
    tensors: list  # [attn_norm, qk_norm?, attn_out_norm?, ffn_norm, ffn_out_norm?, 4 biases?, the parts' tensors]
    cfg: list  # [Hq, Hkv, D, act, bf16 isa, int8 isa, offset, kind, parts of qkv, o, gate_up, down]
    dtype: torch.dtype  # the activations' (and the K/V cache's) dtype


def flatten(specs: list[LayerSpec]) -> tuple[list, list]:
    """(tensors, cfg) of consecutive layers for one decode_layers call: each layer's, one after another."""
    return [t for s in specs for t in s.tensors], [c for s in specs for c in s.cfg]


def _parts(w) -> Optional[tuple[int, list]]:
    """(kind, [[tensors of each part] of qkv, o, gate_up, down]) of a packed dense layer, or None."""
    projections = (w.qkv_t, w.o_t, w.gate_up_t, w.down_t)
    if all(isinstance(p, RowsWeight) for p in projections):
        return KIND_BF16, [[[p.w]] for p in projections]
    if all(type(p) is Int8Weight and p.kernels is not None and p.layer.scales.dtype == torch.float32
           for p in projections):
        return KIND_INT8, [[[p.layer.weight_int8, p.layer.scales]] for p in projections]
    if all(type(p) is Int4Weight and p.packed is not None for p in projections):
        return KIND_INT4, [[list(p.packed)] for p in projections]
    if all(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in projections):
        own = [w.own[n][0] for n in ("q", "k", "v", "o", "gate", "up")] + [w.down_t.t()]
        if all(t.dtype == torch.float32 and t.is_contiguous() for t in own):
            return KIND_F32, [[[t] for t in own[:3]], [[own[3]]], [[own[4]], [own[5]]], [[own[6]]]]
    return None


def layer_spec(w, fused) -> Optional[LayerSpec]:
    """The decode_layer arguments of packed layer `w` of FusedModel `fused`, or None (module docstring)."""
    k = native.kernels()
    if k is None or w.experts is not None or fused.act_name not in ACTS or w.attn_norm.device.type != "cpu":
        return None
    found = _parts(w)
    if found is None:
        return None
    kind, parts = found
    if kind == KIND_INT4 and not k.int4:
        return None
    dtype = torch.bfloat16 if kind == KIND_BF16 else torch.float32
    biases = [w.qkv_b, w.o_b, w.gate_up_b, w.down_b]
    if any(b is not None and b.dtype != dtype for b in biases):
        return None
    norms = [w.attn_norm, w.qk_norm, w.attn_out_norm, w.ffn_norm, w.ffn_out_norm]
    if any(n is not None and (n.dtype not in (torch.float32, torch.bfloat16) or not n.is_contiguous()) for n in norms):
        return None
    tensors = norms + [None if b is None else b.contiguous() for b in biases]
    for projection in parts:
        for part in projection:
            tensors += part
    cfg = [fused.hq, fused.hkv, fused.d, ACTS[fused.act_name], k.bf16_isa, k.int8_isa, int(fused.offset), kind,
           *(len(p) for p in parts)]
    return LayerSpec(tensors, cfg, dtype)
