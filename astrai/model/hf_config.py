"""Hugging Face config.json <-> ModelConfig, family by family, refusing what is not modelled.

`config_from_hf(d, source)` reads what transformers 5 reads (its config classes' defaults for absent
keys, `rope_parameters` or the older `rope_theta` + `rope_scaling`, Gemma 3's per-layer-type RoPE and
`rope_local_base_freq`, Qwen2/3's `use_sliding_window` + `max_window_layers` or `layer_types`,
Gemma 3's `layer_types` or `sliding_window_pattern`) and checks every value it uses: a wrong type,
a value out of range, or a key that changes the computation in a way astrai does not model raises
ModelFileError naming the file and the key. `config_to_hf(c)` writes the keys the family's
transformers config class expects, so the checkpoint loads there as the same architecture. What
differs from family to family (defaults for absent keys, the activation's key, the bias switches,
the sliding-window style, constant keys) is read from its Family record (astrai.model.config);
this module imports that one, never the other way.

Keys checked (beyond the shape keys, which must be positive integers):
  refused when set: quantization_config; attention_dropout != 0; partial_rotary_factor != 1;
    rope types other than default, linear, llama3, yarn (dynamic NTK depends on the sequence
    length); rope_scaling / rope_parameters that are not mappings, or lack their keys (llama3:
    factor, low_freq_factor, high_freq_factor); rope_theta or factor not > 0; activations other
    than silu, gelu_pytorch_tanh, gelu; Gemma 3's attn_logit_softcapping and
    use_bidirectional_attention; Mixtral's router_jitter_noise != 0; num_experts_per_tok outside
    1..experts; mlp_only_layers outside the layers; layer_types of the wrong length or values;
    sliding_window < 1; an architecture or model_type astrai does not model (the image+text
    Gemma3ForConditionalGeneration included).
  modelled: head_dim, attention_bias (llama, qwen3, qwen3_moe, gemma3_text: q/k/v/o), mlp_bias
    (llama), sliding_window (+ use_sliding_window, max_window_layers, layer_types,
    sliding_window_pattern as each family reads them), query_pre_attn_scalar,
    final_logit_softcapping, rope_local_base_freq, tie_word_embeddings, the MoE keys.
  ignored, as transformers' class for that family ignores them: attention_bias on qwen2, mistral,
    mixtral; layer_types on mistral, mixtral, qwen3_moe; unknown keys (auto_map's code is never
    imported: the architecture and model_type decide what is computed).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from astrai.errors import ModelFileError
from astrai.model.config import ACTIVATIONS, ARCHITECTURES, FAMILIES, FULL, LIMITS, SLIDING, Family, ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# HF keys that carry no computation but that users expect to survive a load/save round trip.
_KEPT = ("torch_dtype", "dtype", "transformers_version", "use_cache", "max_window_layers", "sliding_window_pattern")
_MISSING = object()
_LIMIT_OF = {"num_experts": "num_local_experts", "max_window_layers": "num_hidden_layers",
             "sliding_window_pattern": "num_hidden_layers"}  # HF keys bounded as ModelConfig's field


class _Reader:
    """Typed access to a config dict; every complaint names the source file and the key."""

    def __init__(self, d: dict, source: str, defaults: dict):
        self.d, self.source, self.defaults = d, source, defaults

    def fail(self, key: str, why: str):
        raise ModelFileError(f"{self.source}: {key}: {why}")

    def raw(self, key: str, default: Any = _MISSING, nullable: bool = False) -> Any:
        """d[key]; absent (or null, unless nullable) -> default, else the family's default, else an error."""
        v = self.d.get(key, _MISSING)
        if v is None and nullable:
            return None
        if v is None or v is _MISSING:
            v = default if default is not _MISSING else self.defaults.get(key, _MISSING)
        if v is _MISSING:
            self.fail(key, "missing (required)")
        return v

    def int(self, key: str, default: Any = _MISSING, low: int = 1, nullable: bool = False) -> Optional[int]:
        v = self.raw(key, default, nullable)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            self.fail(key, f"must be an integer >= {low}, got {v!r}")
        limit = LIMITS.get(_LIMIT_OF.get(key, key))
        if limit is not None and v > limit:
            self.fail(key, f"{v:,} is more than {limit:,}, beyond any model astrai runs")
        return v

    def number(self, key: str, default: Any = _MISSING, positive: bool = True, d: Optional[dict] = None,
               where: str = "") -> Optional[float]:
        v = (d if d is not None else self.d).get(key)
        if v is None:
            v = self.raw(key, default) if d is None else default
        if v is None or v is _MISSING:
            if v is _MISSING:
                self.fail(where + key, "missing (required)")
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (positive and v == 0):
            self.fail(where + key, f"must be a {'positive' if positive else 'non-negative'} finite number, got {v!r}")
        return float(v)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            self.fail(key, f"must be true or false, got {v!r}")
        return v


def _family(d: dict, source: str) -> str:
    mt, archs = d.get("model_type"), d.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ModelFileError(f"{source}: architectures: must be a list of names, got {archs!r}")
    arch = archs[0] if archs else None
    supported = ", ".join(f"{f.architecture} ({name})" for name, f in FAMILIES.items())
    custom = " (its auto_map names custom code, which astrai never imports)" if d.get("auto_map") else ""
    if mt is None and arch is None:
        return "mixtral" if d.get("num_local_experts") else "llama"  # a hand-written config.json
    if mt is not None and mt not in FAMILIES:
        if mt == "gemma3":
            raise ModelFileError(f"{source}: model_type 'gemma3' is Gemma 3 with its image encoder "
                                 f"({arch or 'Gemma3ForConditionalGeneration'}); astrai models the text-only "
                                 f"Gemma3ForCausalLM (model_type gemma3_text)")
        raise ModelFileError(f"{source}: model_type {mt!r}{custom} is not a family astrai models: {supported}")
    if arch is not None and arch not in ARCHITECTURES:
        raise ModelFileError(f"{source}: architecture {arch!r}{custom} is not one astrai models: {supported}")
    if mt is not None and arch is not None and ARCHITECTURES[arch] != mt:
        raise ModelFileError(f"{source}: architectures {arch!r} and model_type {mt!r} disagree")
    return mt if mt is not None else ARCHITECTURES[arch]


def _rope_params(p: Any, key: str, r: _Reader, theta: Optional[float]) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling dict without rope_theta, or None for the default rope) of one rope block."""
    if not isinstance(p, dict):
        r.fail(key, f"must be a mapping such as {{\"rope_type\": \"linear\", \"factor\": 2.0}}, got {p!r}")
    p = dict(p)
    kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.pop("type", None)
    if kind == "dynamic":
        r.fail(f"{key}.rope_type", "'dynamic' (NTK scaling that changes with the sequence length) is not modelled; "
                                   f"astrai computes {', '.join(ROPE_TYPES)}")
    if kind not in ROPE_TYPES:
        r.fail(f"{key}.rope_type", f"{kind!r} is not modelled; astrai computes {', '.join(ROPE_TYPES)}")
    theta = r.number("rope_theta", theta, d=p, where=f"{key}.")
    p.pop("rope_theta", None)
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        r.fail(f"{key}.partial_rotary_factor", f"{p['partial_rotary_factor']!r}: partial rotary embeddings are "
                                               f"not modelled")
    p.pop("partial_rotary_factor", None)
    if kind == "default":
        return theta, None
    if kind != "yarn" or p.get("factor") is not None:
        p["factor"] = r.number("factor", _MISSING, d=p, where=f"{key}.")
    if kind in ("llama3", "yarn"):
        p["original_max_position_embeddings"] = int(r.number(
            "original_max_position_embeddings", r.raw("max_position_embeddings"), d=p, where=f"{key}."))
    if kind == "llama3":
        low = r.number("low_freq_factor", _MISSING, d=p, where=f"{key}.")
        high = r.number("high_freq_factor", _MISSING, d=p, where=f"{key}.")
        if high <= low:
            r.fail(f"{key}.high_freq_factor", f"must be above low_freq_factor ({low}), got {high}")
    if kind == "yarn":
        for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            r.number(k, None, d=p, where=f"{key}.")
        r.number("attention_factor", None, positive=False, d=p, where=f"{key}.")
        if not isinstance(p.get("truncate", True), bool):
            r.fail(f"{key}.truncate", f"must be true or false, got {p['truncate']!r}")
    return theta, {"rope_type": kind, **p}


def _rope(d: dict, t: Family, r: _Reader) -> dict:
    scaling, params = d.get("rope_scaling"), d.get("rope_parameters")
    top_theta = r.number("rope_theta", r.defaults["rope_theta"])
    if r.raw("partial_rotary_factor", 1.0) != 1.0:
        r.fail("partial_rotary_factor", f"{d['partial_rotary_factor']!r}: partial rotary embeddings are not modelled")
    nested = isinstance(params, dict) and (FULL in params or SLIDING in params)
    if t.gemma:  # a RoPE per layer type: rope_parameters.full_attention / sliding_attention, rope_local_base_freq
        glob = dict(params.get(FULL) or {}) if nested else dict(params or {})
        if scaling is not None:
            if not isinstance(scaling, dict):
                r.fail("rope_scaling", f"must be a mapping, got {scaling!r}")
            glob.update(scaling)
        local = dict(params.get(SLIDING) or {}) if nested else {}
        theta, glob_scaling = _rope_params(glob, "rope_parameters.full_attention" if nested else "rope_scaling",
                                           r, top_theta)
        local_theta, local_scaling = _rope_params(local, "rope_parameters.sliding_attention", r,
                                                  r.number("rope_local_base_freq"))
        return dict(rope_theta=theta, rope_scaling=glob_scaling,
                    local_rope={"rope_theta": local_theta, "rope_type": "default", **(local_scaling or {})})
    key = "rope_scaling" if scaling is not None else "rope_parameters"
    block = scaling if scaling is not None else (params if params is not None else {})
    theta, glob_scaling = _rope_params(block, key, r, top_theta)
    return dict(rope_theta=theta, rope_scaling=glob_scaling)


def _windows(d: dict, t: Family, r: _Reader, layers: int) -> dict:
    if t.windows is None or t.window_switch and not r.flag("use_sliding_window", False):
        return {}
    if t.gemma and "sliding_window" in d and d["sliding_window"] is None:
        r.fail("sliding_window", "null: Gemma 3's local layers need a window")
    window = r.int("sliding_window", r.defaults.get("sliding_window"), nullable=True)
    if window is None or t.windows == "every":
        return dict(sliding_window=window)  # every layer (these classes ignore layer_types)
    types = d.get("layer_types")
    if types is None and t.windows == "sliding_window_pattern":
        pattern = r.int("sliding_window_pattern")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    elif types is None:
        first = r.int("max_window_layers", low=0)
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {FULL, SLIDING}:
        r.fail("layer_types", f"must list {FULL!r} or {SLIDING!r} for each of the {layers} layers, got {types!r}")
    return dict(sliding_window=window, layer_types=tuple(types))


def _experts(d: dict, t: Family, r: _Reader, layers: int) -> dict:
    moe = t.moe
    if moe is None:
        return {}
    key = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    n = r.int(key, r.defaults["num_local_experts"], low=1 if moe == "mixtral" else 0)
    out = dict(num_local_experts=n, router_aux_loss_coef=r.number("router_aux_loss_coef", positive=False))
    k = r.int("num_experts_per_tok")
    if n and k > n:
        r.fail("num_experts_per_tok", f"{k} is more than the {n} experts ({key})")
    out["num_experts_per_tok"] = k
    if moe == "mixtral":
        if r.number("router_jitter_noise", 0.0, positive=False):
            r.fail("router_jitter_noise", f"{d['router_jitter_noise']!r}: router noise in training is not modelled")
        return out
    only = r.raw("mlp_only_layers", [])
    if not isinstance(only, list) or len(only) > layers or \
            not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only):
        r.fail("mlp_only_layers", f"must list layer indices in 0..{layers - 1}, got {only!r}")
    out.update(moe_intermediate_size=r.int("moe_intermediate_size"), norm_topk_prob=r.flag("norm_topk_prob"),
               decoder_sparse_step=r.int("decoder_sparse_step"), mlp_only_layers=tuple(only))
    return out


def _refuse_unmodelled(d: dict, t: Family, r: _Reader):
    if d.get("quantization_config"):
        r.fail("quantization_config", "quantized checkpoints are not loaded; use the unquantized weights")
    if r.number("attention_dropout", 0.0, positive=False):
        r.fail("attention_dropout", f"{d['attention_dropout']!r}: attention dropout is not modelled")
    if t.gemma:
        if d.get("attn_logit_softcapping"):
            r.fail("attn_logit_softcapping", f"{d['attn_logit_softcapping']!r}: attention score soft-capping is "
                                             f"not modelled")
        if d.get("use_bidirectional_attention"):
            r.fail("use_bidirectional_attention", "bidirectional attention is not modelled (causal only)")


def config_from_hf(d: Any, source: str = "config.json") -> ModelConfig:
    if not isinstance(d, dict):
        raise ModelFileError(f"{source}: expected a JSON object, got {type(d).__name__}")
    family = _family(d, source)
    t = FAMILIES[family]
    r = _Reader(d, source, t.defaults)
    _refuse_unmodelled(d, t, r)
    heads = r.int("num_attention_heads")
    hidden = r.int("hidden_size")
    layers = r.int("num_hidden_layers")
    act_key = t.act_key
    act = r.raw(act_key, "silu")
    act = "silu" if act == "swish" else act
    if act not in ACTIVATIONS:
        r.fail(act_key, f"{act!r} is not modelled; astrai computes {', '.join(ACTIVATIONS)}")
    kw: dict[str, Any] = dict(
        family=family, vocab_size=r.int("vocab_size"), hidden_size=hidden,
        intermediate_size=r.int("intermediate_size"), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads if d.get("num_key_value_heads", 0) is None else
        r.int("num_key_value_heads", r.defaults.get("num_key_value_heads", heads)),
        head_dim=r.int("head_dim", r.defaults.get("head_dim", hidden // heads)),
        hidden_act=act, rms_norm_eps=r.number("rms_norm_eps", positive=False),
        max_position_embeddings=r.int("max_position_embeddings"),
        tie_word_embeddings=r.flag("tie_word_embeddings", r.defaults["tie_word_embeddings"]),
        initializer_range=r.number("initializer_range", 0.02, positive=False))
    if heads % kw["num_key_value_heads"]:
        r.fail("num_key_value_heads", f"{kw['num_key_value_heads']} does not divide num_attention_heads ({heads})")
    if kw["head_dim"] % 2:
        r.fail("head_dim", f"{kw['head_dim']} must be even for rotary embeddings")
    for key in ("bos_token_id", "pad_token_id"):
        kw[key] = r.int(key, None, low=0)
    eos = d.get("eos_token_id")
    if eos is not None and not (isinstance(eos, int) or isinstance(eos, list) and all(isinstance(e, int) for e in eos)):
        r.fail("eos_token_id", f"must be a token id or a list of them, got {eos!r}")
    kw["eos_token_id"] = eos
    for key in t.bias_keys:
        kw[key] = r.flag(key)
    if t.gemma:
        kw["query_pre_attn_scalar"] = r.number("query_pre_attn_scalar")
        kw["final_logit_softcapping"] = r.number("final_logit_softcapping", None)
    kw.update(_rope(d, t, r))
    kw.update(_windows(d, t, r, layers))
    kw.update(_experts(d, t, r, layers))
    try:
        return ModelConfig(**kw, extra={k: d[k] for k in _KEPT if k in d})
    except ValueError as e:
        raise ModelFileError(f"{source}: {e}") from None


def _rope_block(theta: float, scaling: Optional[dict]) -> dict:
    return {"rope_theta": theta, "rope_type": "default", **(scaling or {})}


def config_to_hf(c: ModelConfig) -> dict:
    t = c.traits
    d = dict(c.extra)
    d.update({
        "architectures": [c.architecture], "model_type": c.family,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id, "initializer_range": c.initializer_range,
        "torch_dtype": d.get("torch_dtype", "float32"),
    })
    d[t.act_key] = c.hidden_act
    d.update(t.written)
    if t.gemma:
        d["rope_parameters"] = {FULL: _rope_block(c.rope_theta, c.rope_scaling),
                                SLIDING: dict(c.local_rope or _rope_block(c.rope_theta, None))}
        scalar = c.query_pre_attn_scalar  # transformers' Gemma3TextConfig types it int
        d.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                 final_logit_softcapping=c.final_logit_softcapping)
    else:
        d.update(rope_parameters=_rope_block(c.rope_theta, c.rope_scaling), rope_theta=c.rope_theta,
                 rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None)
    d.update({key: getattr(c, key) for key in t.bias_keys})
    if t.window_switch:
        d["use_sliding_window"] = c.sliding_window is not None
    if t.windows is not None:
        d["sliding_window"] = c.sliding_window
    if t.windows in ("max_window_layers", "sliding_window_pattern"):
        d["layer_types"] = [SLIDING if c.is_sliding_layer(i) else FULL for i in range(c.num_hidden_layers)]
    if t.windows == "max_window_layers":
        d.setdefault("max_window_layers", next((i for i in range(c.num_hidden_layers) if c.is_sliding_layer(i)),
                                               c.num_hidden_layers))
    if t.moe == "mixtral":
        d["num_local_experts"] = c.num_local_experts
    if t.moe == "qwen3_moe":
        d.update(num_experts=c.num_local_experts, moe_intermediate_size=c.expert_size,
                 norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                 mlp_only_layers=list(c.mlp_only_layers))
    if t.moe:
        d.update(num_experts_per_tok=c.num_experts_per_tok, router_aux_loss_coef=c.router_aux_loss_coef,
                 output_router_logits=False)
    return d
