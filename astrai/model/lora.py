"""LoRA adapters on the decoder's linear layers, with PEFT's math, names and initialisation.

A target `nn.Linear` W (q_proj ... down_proj, or a MoE expert's w1/w2/w3) becomes a LoraLinear:

    y = W x + (alpha / r) * B(A(dropout(x)))      A: [r, in], B: [out, r]

A is initialised as nn.Linear initialises its weight (kaiming-uniform with a = sqrt(5)) and B at
zero, so a fresh adapter changes nothing (PEFT's `init_lora_weights=True`). Submodule names are
PEFT's (`q_proj.base_layer`, `q_proj.lora_A`, `q_proj.lora_B`), so an adapter's state dict keys
are PEFT's file keys once prefixed with `base_model.model.` (astrai.model.adapter_files).

Only the adapters train: the base is frozen (`requires_grad=False`) and may be held in a lower
precision (`cast`: the base and the activations in `dtype`, A and B in float32, or float64 in a
float64 run); like PEFT, the adapter path computes in its own dtype and adds its result in the
activations' dtype. Under autocast (bf16-mixed training) over a frozen full-precision base, the products are
autocast's own, but the base weight's bf16 copy is made once (astrai.model.casts) instead of at every forward,
and the scale multiplies the rank-r product. `adapters_disabled(model)` switches every adapter off for a
forward, so the frozen base doubles as a reference model (DPO, GRPO's KL) without a second copy of its weights:
`BaseView(model)` is that reference.

QLoRA (`quantize_base`): the frozen base's decoder projections, adapted or not, held in NF4
(astrai.model.quant; embeddings, norms and the LM head stay as they are), dequantized per forward in
the activations' dtype; the adapters are the same modules, names and files as over a full-precision
base, so PEFT loads them over that base. A base loaded already quantized (load_model(quantize=nf4))
is wrapped as it is: `apply_lora` takes quantized linear layers as targets too.

Merging (`merged_state`): W' = W + (alpha / r) * B @ A, computed in float32 (float64 for float64
weights) and stored in W's dtype, under W's own name: a plain checkpoint transformers loads. An NF4
base weight is dequantized first (the merged model is the dequantized base plus the adapters).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn as nn

from astrai.config.train import LORA_DEFAULT_TARGETS, LORA_TARGETS
from astrai.model.casts import autocast_dtype, frozen_cast
from astrai.model.quant import QuantizedLinear, dequantized, quantize_layers


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Adapter:
    """What a LoRA-wrapped model carries about its adapters: the spec and where its frozen base
    came from (a checkpoint directory; None for a model built in memory)."""
    spec: LoraSpec
    base: Optional[str] = None
    quantized: Optional[str] = None  # how the frozen base's projections are held (nf4), None: as loaded


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, spec: LoraSpec):
        super().__init__()
        self.base_layer = base
        device = base.weight.device if isinstance(base, nn.Linear) else next(base.buffers()).device
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=device)
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.scaling = spec.scaling
        self.enabled = True
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self):
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @property
    def weight(self) -> torch.Tensor:  # the base weight, for code that reads a projection's shape or dtype
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x.device.type)
        if dtype is not None and type(self.base_layer) is nn.Linear and not self.base_layer.weight.requires_grad:
            return self._autocast_forward(x, dtype)
        y = self.base_layer(x)
        if not self.enabled:
            return y
        h = self.lora_dropout(x.to(self.lora_A.weight.dtype))
        return y + (self.lora_B(self.lora_A(h)) * self.scaling).to(y.dtype)

    def _autocast_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The forward under autocast (bf16-mixed training) over a frozen full-precision base: the products
        autocast would compute, the same bf16 operands, without its per-call casts of the frozen weight (autocast
        caches casts of weights that require grad only, so it cast each base weight at every forward and kept the
        copy for the backward: 13% of a LoRA step); the base's `dtype` copy is astrai.model.casts.frozen_cast's,
        made once. The adapters' scale multiplies their rank-r product, not the [tokens, out] result (the same
        scalar product, r / out of the work), and B's product adds into the base's result (addmm)."""
        base, x = self.base_layer, x.to(dtype)  # cast once for the base and the adapters
        bias = None if base.bias is None else frozen_cast(base.bias, dtype)
        y = nn.functional.linear(x, frozen_cast(base.weight, dtype), bias)
        if not self.enabled:
            return y
        a = self.lora_A(self.lora_dropout(x)) * self.scaling
        # y + a @ B^T as one product (addmm adds into its result: no separate pass over the [tokens, out] sum)
        out = torch.addmm(y.reshape(-1, y.shape[-1]), a.reshape(-1, a.shape[-1]), self.lora_B.weight.to(dtype).t())
        return out.view(y.shape)


LINEAR = (nn.Linear, QuantizedLinear)  # a base layer: full precision, or quantized as the checkpoint was loaded


def apply_lora(model: nn.Module, spec: LoraSpec, base: Optional[str] = None) -> list[str]:
    """Wrap every linear layer (nn.Linear, or one loaded quantized) whose own name is one of spec.targets;
    freeze everything else. Returns the
    wrapped module names. A target that matches nothing raises (a typo would otherwise train nothing)."""
    if lora_layers(model):
        raise ValueError("the model already carries LoRA adapters")
    model.requires_grad_(False)
    wrapped, seen = [], set()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in spec.targets and isinstance(child, LINEAR):
                setattr(module, child_name, LoraLinear(child, spec))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
                seen.add(child_name)
    missing = [t for t in spec.targets if t not in seen]
    if missing:
        raise ValueError(f"lora target_modules {missing} match no linear layer of this model; its layers are "
                         f"named {sorted(_linear_names(model))}")
    model.adapter = Adapter(spec, base)
    return wrapped


def quantize_base(model: nn.Module, kind: str = "nf4") -> list[str]:
    """QLoRA: every decoder projection of a LoRA-wrapped model's frozen base (the adapted layers' base_layer
    and the projections left unadapted) becomes a `kind` quantized layer; returns their names. Those
    already quantized (a base loaded with load_model(..., quantize=kind)) stay as they are."""
    import dataclasses

    if not has_adapters(model):
        raise ValueError("quantize_base holds a LoRA model's frozen base; apply_lora first")
    done = quantize_layers(model, kind, LORA_TARGETS + ("base_layer",))
    model.adapter = dataclasses.replace(model.adapter, quantized=kind)
    return done


def _linear_names(model: nn.Module) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LINEAR)}


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_adapters(model: nn.Module) -> bool:
    return getattr(_unwrap(model), "adapter", None) is not None


def _unwrap(model):
    return getattr(model, "module", model)


def adapter_dtype(dtype: torch.dtype) -> torch.dtype:
    """Adapters (and so their gradients and AdamW state) stay float32; float64 in a float64 run."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(model: nn.Module, device, dtype: torch.dtype) -> nn.Module:
    """model.to(device, dtype), except that adapters keep adapter_dtype(dtype), never rounded on the way."""
    keep = [(p, p.detach().to(adapter_dtype(dtype))) for layer in lora_layers(model).values()
            for p in (layer.lora_A.weight, layer.lora_B.weight)]
    model = model.to(device=device, dtype=dtype)
    for p, value in keep:
        p.data = value.to(device)
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    layers = lora_layers(_unwrap(model)).values()
    before = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer.enabled = was


class BaseView:
    """The frozen base of a LoRA-wrapped model, usable wherever a reference model is: calling it runs
    the model with every adapter off; its weights are the model's own (no copy)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    @property
    def lm_head(self) -> nn.Module:
        return _unwrap(self.model).lm_head

    @property
    def config(self):
        return _unwrap(self.model).config


# ---- state dicts ------------------------------------------------------------------------------

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def adapter_names(model: nn.Module) -> list[str]:
    """The adapter tensors' names in the model's state dict (`...q_proj.lora_A.weight`)."""
    return [n for n in model.state_dict() if n.endswith(LORA_SUFFIXES)]


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.endswith(LORA_SUFFIXES)}


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped model's full state dict -> the plain model's (HF names), adapters merged."""
    out = {}
    for key, t in state.items():
        if key.endswith(LORA_SUFFIXES):
            continue
        t = dequantized(t)
        if ".base_layer." in key:
            module, param = key.split(".base_layer.")
            if param == "weight":
                t = merge_weight(t, state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"], scaling)
            key = f"{module}.{param}"
        out[key] = t
    return out


def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    w = dequantized(w)
    return (w.to(acc) + scaling * (b.to(acc) @ a.to(acc))).to(w.dtype)
