"""The engine's weights, packed once at load from a model of any family (astrai.model.config).

`pack(model)` reads a CausalLM into a `Packed`: per layer

    attention   q/k/v as one input-major weight ([in, out] contiguous: x @ W) and their biases
                concatenated; the q and k norms (Qwen3, Gemma 3) stacked per head ([Hq + Hkv, D]);
                o as an input-major copy and its bias; the layer's sliding window and RoPE (Gemma 3's
                local layers have their own)
    norms       the model's weights, except Gemma's (1 + w), computed once in float32 (its norms
                multiply in float32 before rounding back)
    dense MLP   gate/up as one input-major weight (and biases), down as a transposed view of the
                model's own weight (no copy: its transposed view is the faster layout) and its bias
    experts     the router's weight, gate/up stacked [E, H, 2I] and down [E, I, H] (input-major), and
                the routing rule (top k, renormalised or not, weights cast back or kept in float32)

bf16 weights on a CPU where astrai's kernels are built are held [out, in] instead (astrai.infer.native's
RowsWeight: q/k/v and gate/up concatenated, o, down and the head the model's own tensors), the layout those
kernels stream; larger steps multiply them by oneDNN's product.

The embedding, the final norm and the LM head (a transposed contiguous copy on the CPU: MKL
streams [hidden, vocab] faster for the few rows of a decode step). On one thread input-major is the
layout MKL's matrix-vector product streams fastest at one or two tokens per step; from 4 to 32 rows (a
batch of decoding requests, a short chunk) the model's own [out, in] weights are the faster layout, so
those steps use them (`own`, no copies); from 32 rows up the layouts are level (bench/cpu_ops.py
--decode-weights; figures in bench/RESULTS.md). On more threads the fused forward splits the products
of small steps over the input-major copies instead (astrai.infer.fused.matmul). The copies cost every projection weight but down
once more in memory (319 MB for SmolLM2-135M in float32).

LoRA: a LoraLinear projection (astrai.model.lora) is read as its merged weight W + (alpha/r) B A
(`merge_weight`, as merged checkpoints are made), or as its base while its adapter is disabled: the
engine serves merged weights and has no adapter path of its own. Anything else in a projection's
place, or a submodule the forward does not know, is refused (UnservableModel) rather than computed
as something else.

Weights change in place (an optimizer step, `load_state_dict`) or are replaced (`param.data = ...`),
and adapters are switched off and on: `WeightWatch` sees each (every parameter's data pointer and
version counter, every adapter's switch), and the runner packs again before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from astrai.infer.native import rows_weight
from astrai.model.layers import MLP, Expert, RMSNorm, SparseMoE, at_least_float32, embed_scale
from astrai.model.casts import tensor_version
from astrai.model.lora import LoraLinear, merge_weight
from astrai.model.rope import Rotary

# steps of this many rows run on the model's own [out, in] weights (`Layer.own`), the others on the
# input-major copies (the faster layout at 1-2 rows; level from 32 up)
OWN_ROWS = (4, 32)
_KNOWN = {  # the submodules each part may have; anything else is refused
    "layer": {"self_attn", "mlp", "block_sparse_moe", "input_layernorm", "post_attention_layernorm",
              "pre_feedforward_layernorm", "post_feedforward_layernorm"},
    "attn": {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"},
    "mlp": {"gate_proj", "up_proj", "down_proj"},
}


class UnservableModel(ValueError):
    pass


@dataclass
class Experts:
    router: torch.Tensor  # [E, H]
    gate_up_t: torch.Tensor  # [E, H, 2I]
    down_t: torch.Tensor  # [E, I, H]
    top_k: int
    renormalise: bool
    cast_back: bool  # routing weights rounded to the activations' dtype (all but Mixtral)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv_t: torch.Tensor  # [H, (Hq + 2 Hkv) * D]
    qkv_b: Optional[torch.Tensor]
    qk_norm: Optional[torch.Tensor]  # [Hq + Hkv, D]
    o_t: torch.Tensor  # [Hq * D, H]
    o_b: Optional[torch.Tensor]
    attn_out_norm: Optional[torch.Tensor]  # Gemma: the attention output's norm
    ffn_norm: torch.Tensor
    ffn_out_norm: Optional[torch.Tensor]  # Gemma: the MLP output's norm
    gate_up_t: Optional[torch.Tensor]  # [H, 2 I]; None in a sparse layer
    gate_up_b: Optional[torch.Tensor]
    down_t: Optional[torch.Tensor]  # [I, H]: a transposed view of the model's weight
    down_b: Optional[torch.Tensor]
    experts: Optional[Experts]
    window: Optional[int]
    rope: Rotary
    # the model's own [out, in] (weight, bias) of q, k, v, o (and gate, up in a dense layer) for steps of
    # OWN_ROWS rows
    own: dict


@dataclass
class Packed:
    embed: torch.Tensor
    embed_scale: Optional[torch.Tensor]
    layers: list[Layer]
    norm: torch.Tensor
    head: torch.Tensor  # [V, H]
    head_t: Optional[torch.Tensor]  # [H, V] contiguous, on the CPU


def linear_weight(m: nn.Module, where: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight [out, in], bias) a projection computes with: a LoRA projection's merged."""
    if type(m) is nn.Linear:
        return m.weight.detach(), None if m.bias is None else m.bias.detach()
    if isinstance(m, LoraLinear) and type(m.base_layer) is nn.Linear:
        w, b = linear_weight(m.base_layer, where)
        if m.enabled:
            w = merge_weight(w, m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.scaling)
        return w, b
    raise UnservableModel(f"{where} is a {type(m).__name__}: the engine serves nn.Linear projections and "
                          "astrai's LoRA ones (merged)")


def _into(shape, like: torch.Tensor, into: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`into` when it can hold a [shape] tensor like `like` (same dtype and device), else None."""
    if into is not None and tuple(into.shape) == tuple(shape) and into.dtype == like.dtype and into.device == like.device:
        return into
    return None


def _input_major(*parts: tuple[torch.Tensor, Optional[torch.Tensor]],
                 into: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """([in, sum of out] contiguous, concatenated biases or None) of (weight, bias) pairs; written into
    `into` when it fits (a repack after each optimizer step of online RL is then a copy, not new memory
    to allocate and fault in)."""
    ts = [p[0].t() for p in parts]
    out = _into((ts[0].shape[0], sum(t.shape[1] for t in ts)), ts[0], into)
    if out is not None:
        with torch.inference_mode():  # `into` may have been made under it (a first step run there)
            w = torch.cat(ts, dim=1, out=out)
    else:
        w = torch.cat(ts, dim=1).contiguous()
    return w, _biases(parts)


def _biases(parts) -> Optional[torch.Tensor]:
    """The (weight, bias) pairs' biases concatenated (zeros for a pair without one), or None when none has one."""
    if all(p[1] is None for p in parts):
        return None
    return torch.cat([p[1] if p[1] is not None else p[0].new_zeros(p[0].shape[0]) for p in parts])


def norm_weight(m: RMSNorm) -> torch.Tensor:
    """What the normalised activations are multiplied by: w, or Gemma's 1 + w in float32 (or float64)."""
    w = m.weight.detach()
    return 1.0 + at_least_float32(w) if m.offset else w


def _check_children(module: nn.Module, kind: str, where: str) -> None:
    extra = {n for n, _ in module.named_children()} - _KNOWN[kind]
    if extra:
        raise UnservableModel(f"{where}: submodules {sorted(extra)} are not part of any family the engine computes")


def _stack(ts: list[torch.Tensor], into: Optional[torch.Tensor]) -> torch.Tensor:
    out = _into((len(ts), *ts[0].shape), ts[0], into)
    if out is None:
        return torch.stack(ts).contiguous()
    with torch.inference_mode():
        return torch.stack(ts, out=out)


def _experts(moe: SparseMoE, where: str, prev: Optional[Experts]) -> Experts:
    gate_up, down = [], []
    for e, ex in enumerate(moe.experts):
        names = ("w1", "w3", "w2") if isinstance(ex, Expert) else ("gate_proj", "up_proj", "down_proj")
        g, u, d = (linear_weight(getattr(ex, n), f"{where}.experts.{e}.{n}") for n in names)
        gate_up.append(torch.cat([g[0].t(), u[0].t()], dim=1))
        down.append(d[0].t())
    return Experts(linear_weight(moe.gate, f"{where}.gate")[0], _stack(gate_up, prev and prev.gate_up_t),
                   _stack(down, prev and prev.down_t), moe.top_k, moe.renormalise, cast_back=not moe.mixtral)


def _projection(parts, into, quantize: Optional[str], name: str):
    """(weight, bias) of a packed projection: the input-major copy; bf16 weights on a CPU with astrai's
    kernels as a RowsWeight ([out, in], astrai.infer.native); or a QuantizedWeight of `quantize`
    (astrai.infer.quantized); with the same concatenated biases."""
    if quantize is None:
        rows = rows_weight([p[0] for p in parts], into)
        if rows is not None:  # bf16 on a CPU with astrai's kernels: [out, in], see astrai.infer.native
            return rows, _biases(parts)
        return _input_major(*parts, into=into if isinstance(into, torch.Tensor) else None)
    from astrai.infer.quantized import quantize_weight

    return quantize_weight(parts, quantize, name), _biases(parts)


def _layer(model, i: int, prev: Optional[Layer] = None, quantize: Optional[str] = None) -> Layer:
    layer, where = model.model.layers[i], f"model.layers.{i}"
    prev = prev if quantize is None else None
    a = layer.self_attn
    _check_children(layer, "layer", where)
    _check_children(a, "attn", f"{where}.self_attn")
    q, k, v, o = (linear_weight(getattr(a, n), f"{where}.self_attn.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    qkv_t, qkv_b = _projection((q, k, v), prev and prev.qkv_t, quantize, f"{where}.self_attn.q_proj/k_proj/v_proj")
    qk_norm = None
    if hasattr(a, "q_norm"):
        qk_norm = torch.cat([norm_weight(a.q_norm).expand(a.hq, a.d), norm_weight(a.k_norm).expand(a.hkv, a.d)])
    ffn = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    w = Layer(attn_norm=norm_weight(layer.input_layernorm), qkv_t=qkv_t, qkv_b=qkv_b, qk_norm=qk_norm,
              o_t=_projection((o,), prev and prev.o_t, quantize, f"{where}.self_attn.o_proj")[0], o_b=o[1],
              attn_out_norm=norm_weight(layer.post_attention_layernorm) if gemma else None,
              ffn_norm=norm_weight(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
              ffn_out_norm=norm_weight(layer.post_feedforward_layernorm) if gemma else None,
              gate_up_t=None, gate_up_b=None, down_t=None, down_b=None, experts=None, window=a.window,
              rope=model.layer_ropes[i], own={"q": q, "k": k, "v": v, "o": o})
    if isinstance(ffn, SparseMoE):
        if quantize is not None:
            raise UnservableModel(f"{where}: a mixture-of-experts layer; quantize covers dense layers only")
        w.experts = _experts(ffn, f"{where}.{'block_sparse_moe' if hasattr(layer, 'block_sparse_moe') else 'mlp'}",
                             prev and prev.experts)
        return w
    if type(ffn) is not MLP:
        raise UnservableModel(f"{where}.mlp is a {type(ffn).__name__}, not a gated MLP or experts")
    _check_children(ffn, "mlp", f"{where}.mlp")
    g, u, d = (linear_weight(getattr(ffn, n), f"{where}.mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
    w.gate_up_t, w.gate_up_b = _projection((g, u), prev and prev.gate_up_t, quantize, f"{where}.mlp.gate_proj/up_proj")
    if quantize is None:  # the model's own weight: as a RowsWeight, else its transposed view (no copy either way)
        w.down_t, w.down_b = rows_weight([d[0]]) or d[0].t(), d[1]
    else:
        w.down_t, w.down_b = _projection((d,), None, quantize, f"{where}.mlp.down_proj")
    w.own.update(gate=g, up=u)
    return w


@torch.no_grad()
def pack(model, into: Optional[Packed] = None, quantize: Optional[str] = None, quantize_head: bool = False) -> Packed:
    """The packed weights of a CausalLM (see the module docstring); raises UnservableModel. The copies
    of `into` (an earlier pack of the same model) are written again where they fit, not reallocated.
    `quantize` (int8 | int4): the decoder's projections as astrai.infer.quantized weights instead of
    input-major copies, and the LM head too with `quantize_head` (the embedding stays as it is)."""
    c = model.config
    head, _ = linear_weight(model.lm_head, "lm_head")
    embed = model.model.embed_tokens.weight.detach()
    scale = embed_scale(c, embed.dtype)
    old = into.layers if into is not None else []
    head_t = None
    if head.device.type == "cpu":
        head_t = _projection(((head, None),), into and into.head_t, quantize if quantize_head else None, "lm_head")[0]
    return Packed(embed=embed, embed_scale=None if scale is None else scale.to(embed.device),
                  layers=[_layer(model, i, old[i] if i < len(old) else None, quantize)
                          for i in range(c.num_hidden_layers)],
                  norm=norm_weight(model.model.norm), head=head, head_t=head_t)


class WeightWatch:
    """Tells whether anything the packed weights are made from changed since the last look: a parameter
    changed in place (its version counter moved: an optimizer step, load_state_dict, copy_) or replaced
    (a new tensor or Parameter under the same name: its data pointer moved), or an adapter switched
    on or off. Costs one read of each parameter's pointer and counter per look."""

    def __init__(self, module: nn.Module):
        seen, self._where = set(), []
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in seen:  # a tied weight once
                    seen.add(id(p))
                    self._where.append((m._parameters, name))
        self._adapters = [m for m in module.modules() if isinstance(m, LoraLinear)]
        self._key = self._now()

    def _now(self) -> list:
        return [(params[name].data_ptr(), tensor_version(params[name])) for params, name in self._where] + \
            [m.enabled for m in self._adapters]

    def forget(self) -> None:
        """The next look reports a change (what was packed from the weights has been dropped)."""
        self._key = None

    def changed(self) -> bool:
        key = self._now()
        if key == self._key:
            return False
        self._key = key
        return True
