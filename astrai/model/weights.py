"""What a config implies about the tensors on disk, checked before anything is allocated.

`expected_shapes(config)` names every tensor of the family's checkpoint layout with its shape,
computed from the config alone (tests check it equals the state dict of the module tree).
`check_tensors(config, headers, source)` compares it with the safetensors headers
(astrai.model.checkpoint_files): the layer count first (so a config claiming 100000 layers fails
in microseconds, not after building them), then missing and unexpected tensors, shapes and dtypes,
each named. `check_fits_memory` refuses a model whose weights alone exceed the machine's available
memory, before a byte is allocated. transformers 5's fused expert layout (mlp.experts.gate_up_proj
[E, 2I, H], mlp.experts.down_proj [E, H, I]) is read as the per-expert layout of the family
(`unfuse_experts`, the same mapping for header shapes and for tensors).
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import torch

from astrai.errors import ModelFileError
from astrai.model.config import ModelConfig

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry; recomputed here
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def expected_shapes(c: ModelConfig) -> dict[str, tuple]:
    h, d, v = c.hidden_size, c.head_dim, c.vocab_size
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    qkv_bias, o_bias = c.traits.qkv_bias or c.attention_bias, c.attention_bias
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", c.num_attention_heads * d), ("k_proj", c.num_key_value_heads * d),
                           ("v_proj", c.num_key_value_heads * d)):
            out[f"{p}self_attn.{name}.weight"] = (rows, h)
            if qkv_bias:
                out[f"{p}self_attn.{name}.bias"] = (rows,)
        out[f"{p}self_attn.o_proj.weight"] = (h, c.num_attention_heads * d)
        if o_bias:
            out[f"{p}self_attn.o_proj.bias"] = (h,)
        if c.traits.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (d,)
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if c.traits.gemma else []
        for n in norms:
            out[f"{p}{n}.weight"] = (h,)
        out.update(_ffn_shapes(c, i, p))
    return out


def _ffn_shapes(c: ModelConfig, i: int, p: str) -> dict[str, tuple]:
    h = c.hidden_size
    if not c.is_sparse_layer(i):
        m, inner = f"{p}mlp.", c.intermediate_size
        out = {f"{m}gate_proj.weight": (inner, h), f"{m}up_proj.weight": (inner, h), f"{m}down_proj.weight": (h, inner)}
        if c.mlp_bias:
            out.update({f"{m}gate_proj.bias": (inner,), f"{m}up_proj.bias": (inner,), f"{m}down_proj.bias": (h,)})
        return out
    inner = c.expert_size
    if c.traits.moe == "mixtral":
        m, parts = f"{p}block_sparse_moe.", (("w1", (inner, h)), ("w3", (inner, h)), ("w2", (h, inner)))
    else:
        m, parts = f"{p}mlp.", (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner)))
    out = {f"{m}gate.weight": (c.num_local_experts, h)}
    for e in range(c.num_local_experts):
        out.update({f"{m}experts.{e}.{name}.weight": shape for name, shape in parts})
    return out


def unfuse_experts(entries: dict, c: ModelConfig, split: Callable) -> dict:
    """Fused expert entries -> the family's per-expert names. `split(x, e, part)` takes expert e's
    gate (part 0) or up (part 1) half of a gate_up_proj entry, or (part None) its down_proj slice."""
    if not c.is_moe or not any(_FUSED.match(k) for k in entries):
        return entries
    mixtral = c.traits.moe == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for key, x in entries.items():
        fused, router = _FUSED.match(key), _FUSED_ROUTER.match(key)
        if fused:
            base = fused.group(1) + (".block_sparse_moe.experts" if mixtral else ".mlp.experts")
            for e in range(c.num_local_experts):
                if fused.group(2) == "gate_up_proj":
                    out[f"{base}.{e}.{names[0]}.weight"] = split(x, e, 0)
                    out[f"{base}.{e}.{names[1]}.weight"] = split(x, e, 1)
                else:
                    out[f"{base}.{e}.{names[2]}.weight"] = split(x, e, None)
        elif router and mixtral:
            out[router.group(1) + ".block_sparse_moe.gate.weight"] = x
        else:
            out[key] = x
    return out


def split_shape(shape: tuple, e: int, part: Optional[int]) -> tuple:
    if len(shape) != 3:
        return shape  # reported as a wrong shape by the caller
    return (shape[1] // 2, shape[2]) if part is not None else (shape[1], shape[2])


def split_tensor(t: torch.Tensor, e: int, part: Optional[int]) -> torch.Tensor:
    return t[e].chunk(2, dim=0)[part] if part is not None else t[e]


def _listing(names: list, limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_tensors(c: ModelConfig, headers: dict, source: str) -> dict:
    """The headers (name -> TensorInfo) in the model's layout, or ModelFileError naming what disagrees."""
    headers = {k: v for k, v in headers.items() if not k.endswith(IGNORED_SUFFIXES)}
    on_disk = {int(m.group(1)) for m in map(_LAYER.match, headers) if m}
    disk_layers = max(on_disk) + 1 if on_disk else 0
    if disk_layers != c.num_hidden_layers:
        raise ModelFileError(f"{source}: config.json has num_hidden_layers {c.num_hidden_layers} but the weights "
                             f"hold {disk_layers} layers")
    bad = [f"{n} ({i.dtype})" for n, i in headers.items() if i.dtype not in _TORCH_DTYPES]
    if bad:
        raise ModelFileError(f"{source}: tensors that are not floating point, as model weights must be: "
                             f"{_listing(sorted(bad))}")
    shapes = unfuse_experts({n: i.shape for n, i in headers.items()}, c, split_shape)
    expected = expected_shapes(c)
    if c.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # stored by some writers, ignored when tied (as HF does)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {len(missing)}: {_listing(missing)}"] if missing else []) + \
                ([f"unexpected {len(unexpected)}: {_listing(unexpected)}"] if unexpected else [])
        raise ModelFileError(f"{source}: the weights do not match config.json ({c.architecture}): " + "; ".join(parts))
    wrong = [f"{n} is {list(shapes[n])}, config.json implies {list(s)}" for n, s in expected.items()
             if tuple(shapes[n]) != s]
    if wrong:
        raise ModelFileError(f"{source}: tensor shapes disagree with config.json: {_listing(wrong, 4)}")
    return shapes


def parameter_count(c: ModelConfig) -> int:
    """Parameters the config implies (a tied head counted once), from arithmetic alone."""
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    attn = 2 * q * h + 2 * kv * h + (q + 2 * kv if c.traits.qkv_bias or c.attention_bias else 0)
    attn += (h if c.attention_bias else 0) + (2 * d if c.traits.qk_norm else 0)
    norms = (4 if c.traits.gemma else 2) * h
    dense = 3 * h * c.intermediate_size + ((2 * c.intermediate_size + h) if c.mlp_bias else 0)
    sparse = c.num_local_experts * (3 * h * c.expert_size + h)
    n_sparse = sum(1 for i in range(c.num_hidden_layers) if c.is_sparse_layer(i)) if c.is_moe else 0
    layers = c.num_hidden_layers * (attn + norms) + n_sparse * sparse + (c.num_hidden_layers - n_sparse) * dense
    return c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h + layers


def available_memory() -> Optional[int]:
    """Bytes of memory the machine can still give (Linux MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_memory(c: ModelConfig, dtype: torch.dtype, source: str):
    """Refuse, before allocating, weights that alone would not fit the machine's available memory."""
    need = parameter_count(c) * torch.empty((), dtype=dtype).element_size()
    have = available_memory()
    if have is not None and need > have:
        raise ModelFileError(f"{source}: the model's weights need {need / 2 ** 30:,.1f} GiB in {str(dtype)[6:]} "
                             f"({parameter_count(c):,} parameters: hidden_size {c.hidden_size}, num_hidden_layers "
                             f"{c.num_hidden_layers}, vocab_size {c.vocab_size}) but the machine has "
                             f"{have / 2 ** 30:,.1f} GiB available")


def torch_dtype(code: str) -> torch.dtype:
    return _TORCH_DTYPES[code]


def nonfinite(t: torch.Tensor) -> bool:
    return bool(t.is_floating_point() and not torch.isfinite(t).all())
