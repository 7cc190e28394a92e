"""The model's shape: one frozen dataclass that reads and writes Hugging Face's config.json.

`ModelConfig.to_hf()` writes a dict that transformers reads as LlamaForCausalLM (dense) or
MixtralForCausalLM (when num_local_experts > 0); `ModelConfig.from_hf(d)` reads either back, so a
checkpoint a user already has (a Llama/Mistral/Qwen2-style Llama config, or Mixtral) loads here.
Keys we do not model are ignored on read only when they do not change the computation; the ones
that do (attention/MLP biases, sliding windows, other activations) raise, rather than loading a
model that silently computes something else.

Presets (`ModelConfig.preset("tiny")`) are named shapes for tests, benchmarks and recipes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

_ARCH_DENSE = "LlamaForCausalLM"
_ARCH_MOE = "MixtralForCausalLM"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8           # < num_attention_heads: grouped-query attention
    head_dim: Optional[int] = None         # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None    # None | {"rope_type": "linear"|"llama3", ...} as HF writes it
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[Any] = 2        # int or list of ints (Llama 3 writes a list)
    pad_token_id: Optional[int] = None
    # Mixture of experts (Mixtral layout); dense when num_local_experts == 0.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.01
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, compare=False)  # HF keys kept verbatim on round trip

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_local_experts}")

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    # ---- Hugging Face config.json -------------------------------------------------------------

    def to_hf(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": [_ARCH_MOE if self.is_moe else _ARCH_DENSE],
            "model_type": "mixtral" if self.is_moe else "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "initializer_range": self.initializer_range,
            "torch_dtype": d.get("torch_dtype", "float32"),
        })
        if self.is_moe:
            d.update({"num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
                      "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": False,
                      "sliding_window": None})
        else:
            d.update({"mlp_bias": False, "pretraining_tp": 1})
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        _refuse_unsupported(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: d.pop(k) for k in list(d) if k in names}
        # transformers 5 writes rope settings as rope_parameters={"rope_type", "rope_theta", ...}
        params = d.pop("rope_parameters", None)
        if params:
            params = dict(params)
            kwargs.setdefault("rope_theta", params.pop("rope_theta", cls.rope_theta))
            if params.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = params
        scaling = kwargs.get("rope_scaling")
        if scaling:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type"))
            if scaling["rope_type"] == "default":
                scaling = None
            elif scaling["rope_type"] not in ("linear", "llama3"):
                raise ValueError(f"rope_scaling type {scaling['rope_type']!r} is not supported (linear, llama3)")
            kwargs["rope_scaling"] = scaling
        if not kwargs.get("num_local_experts"):  # a dense config (None or 0 experts)
            kwargs.pop("num_local_experts", None)
            kwargs.pop("num_experts_per_tok", None)
        keep = {k: v for k, v in d.items() if k in _KEPT_HF_KEYS}
        return cls(**kwargs, extra=keep)

    # ---- presets -----------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# HF keys that carry no computation but that users expect to survive a load/save round trip.
_KEPT_HF_KEYS = {"torch_dtype", "dtype", "transformers_version", "use_cache"}


def _refuse_unsupported(d: dict):
    problems = []
    if d.get("attention_bias"):
        problems.append("attention_bias=true")
    if d.get("mlp_bias"):
        problems.append("mlp_bias=true")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} (only silu/SwiGLU)")
    if d.get("sliding_window") and d.get("use_sliding_window", True) and d.get("model_type") != "mixtral":
        problems.append("sliding_window attention")
    if d.get("sliding_window") and d.get("model_type") == "mixtral" and \
            d["sliding_window"] < d.get("max_position_embeddings", 0):
        problems.append(f"sliding_window={d['sliding_window']} shorter than the context")
    if problems:
        raise ValueError("this config.json asks for what astrai's model does not compute: " + ", ".join(problems))


# Named shapes. tiny: unit tests (fast on 2 CPU cores); small/base: the benchmark shapes (bench/train.py).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "tiny-moe": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=2048),
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    "base": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True,
               max_position_embeddings=8192,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
