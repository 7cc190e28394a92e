"""The engine's forward on fused projection weights: q/k/v in one matmul, gate/up in one.

`FusedModel(model)` keeps, per layer, one weight for q/k/v (and their biases, when the model has
them), one for gate/up and a copy of o, built from the model's own separate nn.Linear modules,
which stay what training, LoRA and checkpoints use. These are stored input-major ([in, out],
contiguous; x @ W rather than nn.Linear's x @ W^T on [out, in]), the layout MKL's matrix-vector
product streams fastest at one or two tokens per step, except down, which stays the model's own
weight (its transposed view is the faster one). From 4 to 32 rows (OWN_ROWS: a batch of decoding
requests, a short chunk) the model's own [out, in] weights are the faster layout, so those steps use
them, one matmul per projection; from 32 rows up the layouts are level. The layouts were chosen
with bench/cpu_ops.py --decode-weights (figures in bench/RESULTS.md).
`forward(ids, positions, ctx)` computes what
`CausalLM.forward` computes (same operations in the same order, so the same numbers up to the
matmul's own blocking), with fewer and larger operations:

    per layer: rms_norm -> qkv matmul -> RoPE in place on the q and k parts -> attention (the
    context: K/V write, decode or ragged prefill) -> o matmul + residual -> rms_norm -> gate/up
    matmul -> silu * up -> down matmul + residual

RoPE uses cos/sin gathered once per step (`ctx.rope_tables`), shared by every layer, as
x * cos + swap_halves(x) * sin_signed, where sin_signed is sin with its first half negated: the
same products and sum as Hugging Face's x * cos + rotate_half(x) * sin (a negation is exact).

Weights change in place (an optimizer step, `load_state_dict`) or are replaced (`param.data = ...`):
`WeightWatch` sees either (each parameter's data pointer and version counter), and the runner
calls `rebuild()` before the next step (astrai.infer.runner). The copies cost the layers' projection
weights but down once more in memory (319 MB for SmolLM2-135M in float32).

`unsupported(model)` says why a model must take the reference path (the model's own forward):
a mixture of experts, a projection that is not a plain nn.Linear (LoRA-wrapped), or a config field
this forward does not implement set to a non-default value (a model family added later falls back
until this forward learns it, rather than computing something else).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from astrai.model.config import ModelConfig
from astrai.model.transformer import at_least_float32

# ModelConfig fields whose every value this forward implements (the rest must keep their defaults)
IMPLEMENTED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
               "initializer_range", "extra", "router_aux_loss_coef", "num_experts_per_tok", "num_local_experts"}
# steps of this many rows run on the model's own [out, in] weights (FusedLayer.*_own), the others on the
# input-major fused copies (the faster layout at 1-2 rows; level from 32 up)
OWN_ROWS = (4, 32)
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj"}
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def unsupported(model) -> Optional[str]:
    """Why the fused forward cannot compute this model, or None when it can."""
    c: ModelConfig = model.config
    if c.is_moe:
        return "a mixture of experts"
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    for f in dataclasses.fields(c):
        if f.name not in IMPLEMENTED and getattr(c, f.name) != defaults.get(f.name, object()):
            return f"config field {f.name}={getattr(c, f.name)!r}"
    for i, layer in enumerate(model.model.layers):
        for mod, allowed in ((layer, _LAYER_CHILDREN), (layer.self_attn, _ATTN_CHILDREN), (layer.mlp, _MLP_CHILDREN)):
            extra = {n for n, _ in mod.named_children()} - allowed
            if extra:
                return f"layer {i}: unknown submodules {sorted(extra)}"
        for name in _ATTN_CHILDREN | _MLP_CHILDREN:
            owner = layer.self_attn if name in _ATTN_CHILDREN else layer.mlp
            m = getattr(owner, name)
            if type(m) is not nn.Linear:
                return f"layer {i}: {name} is a {type(m).__name__}, not a plain nn.Linear"
    return None


@dataclass
class FusedLayer:
    """One layer's weights for the fused forward (see the module docstring for the layouts)."""
    ln1: torch.Tensor
    qkv_t: torch.Tensor  # [H, (Hq + 2 Hkv) * D]
    qkv_bias: Optional[torch.Tensor]
    o_t: torch.Tensor  # [Hq * D, H]
    ln2: torch.Tensor
    gate_up_t: torch.Tensor  # [H, 2 I]
    down_t: torch.Tensor  # [I, H]: a transposed view of the model's [H, I] weight, no copy
    # the model's own [out, in] weights (no copies), for steps of OWN_ROWS rows
    qkv_own: tuple  # ((weight, bias or None) of q, k and v)
    o_own: torch.Tensor
    gate_own: torch.Tensor
    up_own: torch.Tensor


def _input_major(*linears: nn.Linear, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[in, sum of out] contiguous: the linears' weights side by side, each transposed; written into
    `into` when it has that shape, dtype and device (no new memory)."""
    parts = [m.weight.detach().t() for m in linears]
    w = parts[0]
    shape = (w.shape[0], sum(p.shape[1] for p in parts))
    if into is not None and into.shape == shape and into.dtype == w.dtype and into.device == w.device:
        with torch.inference_mode():  # `into` may have been made under it (a first step run there)
            return torch.cat(parts, dim=1, out=into)
    return torch.cat(parts, dim=1).contiguous()


def _version(p: torch.Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # a tensor made under inference_mode keeps no version counter
        return -1


def _cat_bias(*linears: nn.Linear) -> Optional[torch.Tensor]:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


class WeightWatch:
    """Tells whether any parameter of a module changed since the last look: changed in place (its
    version counter moved: an optimizer step, load_state_dict, copy_) or replaced (a new tensor or
    Parameter object under the same name: its data pointer moved). Costs one read of each
    parameter's pointer and counter per look."""

    def __init__(self, module: nn.Module):
        seen, self._where = set(), []
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in seen:  # a tied weight once
                    seen.add(id(p))
                    self._where.append((m._parameters, name))
        self._key = self._now()

    def _now(self) -> list:
        return [(params[name].data_ptr(), _version(params[name])) for params, name in self._where]

    def forget(self) -> None:
        """The next look reports a change (what was built from the weights has been dropped)."""
        self._key = None

    def changed(self) -> bool:
        key = self._now()
        if key == self._key:
            return False
        self._key = key
        return True


class FusedModel:
    def __init__(self, model):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the fused forward cannot compute this model: {why}")
        self.model = model
        c = model.config
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.layers: list[FusedLayer] = []
        self.builds = 0  # how many times the fused copies were made (tests watch the rebuilds)
        self.own_rows = OWN_ROWS
        self.rebuild()

    @torch.no_grad()
    def rebuild(self) -> None:
        """(Re)make the fused copies from the model's current weights: into the copies already there
        when they fit (a weight sync after each optimizer step of online RL is then a copy, not new
        memory to allocate and fault in), else new ones."""
        old, self.layers = self.layers, []
        for i, layer in enumerate(self.model.model.layers):
            a, m = layer.self_attn, layer.mlp
            prev = old[i] if i < len(old) else None
            self.layers.append(FusedLayer(
                ln1=layer.input_layernorm.weight.detach(),
                qkv_t=_input_major(a.q_proj, a.k_proj, a.v_proj, into=prev.qkv_t if prev else None),
                qkv_bias=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                o_t=_input_major(a.o_proj, into=prev.o_t if prev else None),
                ln2=layer.post_attention_layernorm.weight.detach(),
                gate_up_t=_input_major(m.gate_proj, m.up_proj, into=prev.gate_up_t if prev else None),
                down_t=m.down_proj.weight.detach().t(),
                qkv_own=tuple((p.weight.detach(), None if p.bias is None else p.bias.detach())
                              for p in (a.q_proj, a.k_proj, a.v_proj)),
                o_own=a.o_proj.weight.detach(), gate_own=m.gate_proj.weight.detach(),
                up_own=m.up_proj.weight.detach()))
        self.builds += 1

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> torch.Tensor:
        """hidden [T, H] after the final norm, as CausalLM.forward returns it."""
        model = self.model
        x = model.model.embed_tokens(input_ids)
        tables = ctx.rope_tables(position_ids, model.rope)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, position_ids, tables, ctx)
        return rms_norm(x, model.model.norm.weight, self.eps)

    __call__ = forward

    def _layer(self, i: int, w: FusedLayer, x, position_ids, tables, ctx):
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        own = self.own_rows[0] <= t <= self.own_rows[1]  # the model's own weights, one matmul per projection
        h = rms_norm(x, w.ln1, self.eps)
        if own:
            qkv = torch.cat([F.linear(h, weight, bias) for weight, bias in w.qkv_own], 1)
        else:
            qkv = h @ w.qkv_t if w.qkv_bias is None else torch.addmm(w.qkv_bias, h, w.qkv_t)
        qkv = qkv.view(t, hq + 2 * hkv, d)
        if tables is not None:
            rope_in_place(qkv[:, :hq + hkv], *tables)
            q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
        else:  # the backend applies RoPE itself (a fused kernel)
            q, k = ctx.rotary(qkv[:, :hq], qkv[:, hq:hq + hkv], position_ids, self.model.rope)
        o = ctx.attend(i, q, k, qkv[:, hq + hkv:])
        x = torch.addmm(x, o.reshape(t, hq * d), w.o_own.t() if own else w.o_t)
        h = rms_norm(x, w.ln2, self.eps)
        if own:
            act = F.silu(F.linear(h, w.gate_own)).mul_(F.linear(h, w.up_own))
        else:
            gu = h @ w.gate_up_t
            inter = gu.shape[-1] // 2
            act = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
        return torch.addmm(x, act, w.down_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm. In float32 torch's rms_norm runs the same operations in C++ (bit-identical,
    fewer Python calls); in other dtypes it rounds once where Hugging Face rounds twice, so the
    model's formula is kept there."""
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    h = at_least_float32(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(position_ids: torch.Tensor, rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin_signed) [T, 1, D] in the activations' dtype for `rope_in_place`, once per step."""
    cos, sin = rope.cos_sin(position_ids)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def rope_in_place(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """x [T, H, D] <- x * cos + swap_halves(x) * sin_signed (Hugging Face's half-split rotary)."""
    swapped = x.roll(x.shape[-1] // 2, -1)  # a copy: [x2, x1]
    swapped.mul_(sin_signed)
    x.mul_(cos).add_(swapped)
