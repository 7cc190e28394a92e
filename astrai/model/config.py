"""The model's shape: one frozen dataclass, and the decoder families it can describe.

A family is what Hugging Face calls the model type (config.json `model_type`): it fixes the
architecture name written back (a Qwen2 saved by astrai is a Qwen2ForCausalLM) and the traits that
are not config keys but code in transformers' modelling files:

    llama        LlamaForCausalLM      RMSNorm, RoPE, SwiGLU, GQA; optional q/k/v/o and MLP biases
    mistral      MistralForCausalLM    + a sliding window on every layer
    qwen2        Qwen2ForCausalLM      + q/k/v biases (o_proj none); windows on layers >= max_window_layers
    qwen3        Qwen3ForCausalLM      + RMSNorm over head_dim on q and k before RoPE
    gemma3_text  Gemma3ForCausalLM     q/k norms; (1+w) RMSNorm in float32; embeddings times
                                       sqrt(hidden) (rounded to the activation dtype); GELU-tanh gating;
                                       norms before and after attention and MLP; softmax scale
                                       query_pre_attn_scalar^-0.5; local (sliding) and global layers
                                       with their own RoPE bases; optional final logit soft-capping
    mixtral      MixtralForCausalLM    top-k softmax router (renormalised), experts w1/w2/w3
    qwen3_moe    Qwen3MoeForCausalLM   q/k norms; router with optional renormalisation
                                       (norm_topk_prob); dense MLP layers by mlp_only_layers /
                                       decoder_sparse_step; experts gate/up/down_proj

Each family's record (Family) holds these traits and the rules its config.json is read and written
by; the reading and writing is astrai.model.hf_config (config_from_hf / config_to_hf), which
imports this module, never the other way. Presets (`ModelConfig.preset("tiny")`) are named shapes
for tests, benchmarks and recipes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Family:
    """One decoder family: what it computes beyond the config's keys, and how its config.json reads
    (transformers' config class for it). Adding a family is adding one record."""
    architecture: str
    qkv_bias: bool = False   # q/k/v projections always carry a bias, o_proj none (Qwen2)
    qk_norm: bool = False    # RMSNorm over head_dim on q and k, before RoPE
    gemma: bool = False      # Gemma's norms, embedding scale, sandwich norms and softmax scale, and its keys:
    #                          query_pre_attn_scalar, final_logit_softcapping, a local RoPE, a window it needs
    moe: Optional[str] = None  # expert layout: "mixtral" or "qwen3_moe"
    with_experts: Optional[str] = None  # the family this one becomes with num_local_experts > 0
    bias_keys: tuple = ()    # optional bias switches its config reads: attention_bias (q/k/v/o), mlp_bias
    act_key: str = "hidden_act"  # the key naming the MLP's activation
    windows: Optional[str] = None  # None: no sliding window; "every": every layer slides (layer_types ignored);
    #                                "max_window_layers" / "sliding_window_pattern": per layer, from layer_types
    #                                or else from that key
    window_switch: bool = False  # the window applies only with use_sliding_window: true
    defaults: dict = field(default_factory=dict, compare=False)  # its config class's values for absent keys
    written: dict = field(default_factory=dict, compare=False)   # constant keys its config class expects


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", with_experts="mixtral", bias_keys=("attention_bias", "mlp_bias"),
                    defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                                  tie_word_embeddings=False),
                    written=dict(pretraining_tp=1)),
    "mistral": Family("MistralForCausalLM", windows="every",
                      defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=131072,
                                    num_key_value_heads=8, sliding_window=4096, tie_word_embeddings=False)),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, windows="max_window_layers", window_switch=True,
                    defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                                  sliding_window=4096, max_window_layers=28, tie_word_embeddings=False)),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, bias_keys=("attention_bias",), windows="max_window_layers",
                    window_switch=True,
                    defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                                  sliding_window=4096, max_window_layers=28, head_dim=128, tie_word_embeddings=False)),
    "gemma3_text": Family("Gemma3ForCausalLM", qk_norm=True, gemma=True, bias_keys=("attention_bias",),
                          act_key="hidden_activation", windows="sliding_window_pattern",
                          defaults=dict(rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                        head_dim=256, max_position_embeddings=131072, num_key_value_heads=4,
                                        sliding_window=4096, query_pre_attn_scalar=256, sliding_window_pattern=6,
                                        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
                          written=dict(attn_logit_softcapping=None, use_bidirectional_attention=False)),
    "mixtral": Family("MixtralForCausalLM", moe="mixtral", windows="every",
                      defaults=dict(rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072,
                                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                                    router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False),
                      written=dict(router_jitter_noise=0.0)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, moe="qwen3_moe", bias_keys=("attention_bias",),
                        windows="every", window_switch=True,
                        defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                                      num_key_value_heads=4, sliding_window=4096, num_local_experts=128,
                                      num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                                      decoder_sparse_step=1, router_aux_loss_coef=0.001, tie_word_embeddings=False)),
}
ARCHITECTURES = {f.architecture: name for name, f in FAMILIES.items()}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# The largest count a config may claim, per key: far above any released model (405B: 126 layers,
# 128 heads, hidden 16384; 384 experts; a 262k vocabulary; 10M positions), low enough that what is
# built per layer, expert, head or token id stays small. A config over one is refused by the key
# before anything is built from it (config.json through astrai.model.hf_config, and any ModelConfig).
LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 4096,
          "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1 << 14,
          "max_position_embeddings": 1 << 28, "sliding_window": 1 << 28, "num_local_experts": 4096,
          "num_experts_per_tok": 4096, "moe_intermediate_size": 1 << 20, "decoder_sparse_step": 4096}
MAX_TENSORS = 1 << 18  # weight tensors per model (a 61-layer, 384-expert model has 70k)


@dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"                  # FAMILIES key (HF model_type); llama with experts is mixtral
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8           # < num_attention_heads: grouped-query attention
    head_dim: Optional[int] = None         # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"               # the gated MLP's activation (ACTIVATIONS)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None    # None | {"rope_type": "linear"|"llama3"|"yarn", ...} as HF writes it
    local_rope: Optional[dict] = None      # sliding layers' own RoPE {"rope_theta", "rope_type", ...}; None: shared
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False           # biases on q/k/v/o (families other than qwen2/mistral/mixtral)
    mlp_bias: bool = False                 # biases on gate/up/down (llama)
    sliding_window: Optional[int] = None   # a query sees itself and the window - 1 tokens before it
    layer_types: Optional[tuple] = None    # per layer FULL | SLIDING; None: every layer slides when windowed
    query_pre_attn_scalar: Optional[float] = None  # softmax scale = this ** -0.5; None: head_dim ** -0.5
    final_logit_softcapping: Optional[float] = None  # logits = cap * tanh(logits / cap)
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[Any] = 2        # int or list of ints (Llama 3 writes a list)
    pad_token_id: Optional[int] = None
    # Mixture of experts; dense when num_local_experts == 0.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None  # an expert's width; None: intermediate_size
    norm_topk_prob: bool = True            # renormalise the top-k router weights (always, in Mixtral)
    decoder_sparse_step: int = 1           # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple = ()            # ... and i is not listed here (Qwen3-MoE)
    router_aux_loss_coef: float = 0.01
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, compare=False)  # HF keys kept verbatim on round trip

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.num_local_experts > 0 and self.traits.with_experts:  # a Llama with experts is a Mixtral
            object.__setattr__(self, "family", self.traits.with_experts)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        if self.layer_types is not None:  # one spelling per meaning: None when no layer or every layer slides
            types = tuple(self.layer_types)
            plain = self.sliding_window is None or len(types) == self.num_hidden_layers and set(types) == {SLIDING}
            object.__setattr__(self, "layer_types", None if plain else types)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "decoder_sparse_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        self._check_limits()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer or null, got {self.sliding_window}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                             or not set(self.layer_types) <= {FULL, SLIDING}):
            raise ValueError(f"layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                             f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        for key in ("attention_bias", "mlp_bias"):
            if getattr(self, key) and key not in self.traits.bias_keys:
                raise ValueError(f"{key} does not apply to the {self.family} family (its biases are fixed)")
        if self.traits.moe == "mixtral" and not self.is_moe:
            raise ValueError("a mixtral model needs num_local_experts >= 1")
        if self.is_moe and not self.traits.moe:
            raise ValueError(f"the {self.family} family has no experts (num_local_experts must be 0)")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_local_experts}")

    def _check_limits(self):
        for name, limit in LIMITS.items():
            v = getattr(self, name)
            if isinstance(v, int) and v > limit:
                raise ValueError(f"{name} {v:,} is more than {limit:,}, beyond any model astrai runs")
        tensors = self.num_hidden_layers * (16 + 3 * self.num_local_experts)
        if tensors > MAX_TENSORS:
            raise ValueError(f"num_hidden_layers {self.num_hidden_layers} with num_local_experts "
                             f"{self.num_local_experts} is some {tensors:,} weight tensors, more than "
                             f"{MAX_TENSORS:,}, beyond any model astrai runs")

    # ---- derived ------------------------------------------------------------------------------

    @property
    def traits(self) -> Family:
        return FAMILIES[self.family]

    @property
    def architecture(self) -> str:
        return self.traits.architecture

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_sparse_layer(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def is_sliding_layer(self, i: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[i] == SLIDING

    def layer_window(self, i: int) -> Optional[int]:
        """The sliding window of layer i, or None for full causal attention."""
        return self.sliding_window if self.is_sliding_layer(i) else None

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.is_sliding_layer(i) for i in range(self.num_hidden_layers))

    @property
    def softmax_scale(self) -> Optional[float]:
        """Every layer's softmax scale; None for the usual 1/sqrt(head_dim)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    # ---- presets -----------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


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
