"""LoRA adapters on disk in PEFT's format, and checkpoints that may be adapters.

An adapter directory holds
  adapter_config.json        PEFT's LoraConfig: peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
                             lora_dropout, target_modules, base_model_name_or_path (the absolute
                             path of the frozen base checkpoint it was trained on)
  adapter_model.safetensors  `base_model.model.<module path>.lora_A.weight` [r, in] and `.lora_B.weight`
                             [out, r] per adapted layer (PEFT's keys: `peft.PeftModel.from_pretrained(
                             base, DIR)` loads it), plus metadata naming the base's architecture
so the base is never copied. `save_adapter` writes both atomically (temporary name + rename).

`load_checkpoint(DIR, base=None)` is what generation, eval and a train stage's `model:` use: a plain
checkpoint loads as is; an adapter directory loads its base (`base`, else base_model_name_or_path:
absolute, or relative to the adapter directory, then to the working directory) and merges the
adapters into it (W + alpha/r * B @ A; `use_rslora` adapters: alpha/sqrt(r)). The adapter's files
are untrusted input, read as a checkpoint's are (regular files only, bounded JSON, the safetensors
header checked against the file before any tensor: astrai.model.checkpoint_files), and everything
the adapter needs from the base is checked before a weight is read, against the base's config.json
alone: adapter_config.json's values (astrai.model.adapter_config), another architecture, a target
module the base lacks, a tensor for a module target_modules does not select, an A without its B,
a shape that does not fit the base's layer, tensors that would not fit in memory. Then the adapter's
tensors are checked finite, and each merged weight too (a scaling that overflows the weights'
dtype). Every refusal is one line (AdapterError, a ModelFileError) naming the file and the key or
tensor.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from astrai.model.adapter_config import ADAPTER_CONFIG, AdapterConfig, AdapterError, read_adapter_config, suffixes
from astrai.model.checkpoint_files import FLOAT_DTYPES, TensorInfo, read_header_and_metadata
from astrai.model.config import ModelConfig
from astrai.model.hf_checkpoint import CONFIG, load_model, read_config, read_tensors, save_model
from astrai.runtime import atomic_write_text, fresh_tmp, fsync_replace
from astrai.model.lora import Adapter, adapter_state, has_adapters, merge_weight
from astrai.model.transformer import CausalLM
from astrai.model.weights import available_memory, nonfinite

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterError", "check_adapter", "is_adapter", "load_checkpoint",
           "read_adapter", "read_adapter_config", "read_adapter_header", "resolve_base", "save_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_ARCH_KEY = "astrai.base_architecture"


def is_adapter(directory: Union[str, os.PathLike]) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).exists()


# ---- writing ----------------------------------------------------------------------------------

def peft_config(adapter: Adapter) -> dict:
    s = adapter.spec
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": adapter.base,
            "r": s.rank, "lora_alpha": s.alpha, "lora_dropout": s.dropout, "target_modules": sorted(s.targets),
            "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def save_adapter(model: CausalLM, directory: Union[str, os.PathLike], state: Optional[dict] = None) -> Path:
    """The adapters of a LoRA-wrapped model (or of `state`, its full or adapter-only state dict when
    gathered elsewhere) in PEFT's layout."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sd = adapter_state(model.state_dict() if state is None else state)
    tensors = {PREFIX + k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    arch = model.config.architecture
    weights = out / ADAPTER_WEIGHTS
    tmp = fresh_tmp(weights)
    save_file(tensors, str(tmp), metadata={"format": "pt", _ARCH_KEY: arch})
    fsync_replace(tmp, weights)
    atomic_write_text(out / ADAPTER_CONFIG, json.dumps(peft_config(model.adapter), indent=2, sort_keys=True) + "\n")
    return out


# ---- reading ----------------------------------------------------------------------------------

def _model_name(key: str) -> str:
    """PEFT's file key -> the model's own name (`base_model.model.` dropped, `.lora_A.default.weight`
    -> `.lora_A.weight`)."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name)


def read_adapter_header(directory: Union[str, os.PathLike]) -> tuple[dict[str, TensorInfo], dict]:
    """(the tensors adapter_model.safetensors declares, under the model's own names, e.g.
    `model.layers.0.self_attn.q_proj.lora_A.weight`; its metadata). Only the header is read, from a
    regular file, checked against the file's size (astrai.model.checkpoint_files)."""
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.exists() and not path.is_symlink():
        raise AdapterError(f"{directory}: {ADAPTER_CONFIG} without {ADAPTER_WEIGHTS} (a pickled adapter_model.bin "
                           f"is never loaded)")
    infos, meta = read_header_and_metadata(path)
    out: dict[str, TensorInfo] = {}
    for key, info in infos.items():
        name = _model_name(key)
        if name in out:
            raise AdapterError(f"{path}: tensors {out[name].name!r} and {key!r} are both {name!r}")
        out[name] = info
    return out, meta


def read_adapter(directory: Union[str, os.PathLike],
                 infos: Optional[dict[str, TensorInfo]] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(the tensors under the model's own names, each checked finite; the file's metadata)."""
    meta = {}
    if infos is None:
        infos, meta = read_adapter_header(directory)
    path = Path(directory) / ADAPTER_WEIGHTS
    tensors = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name, info in infos.items():
                tensors[name] = f.get_tensor(info.name)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{path}: cannot read its tensors: {e}") from None
    for name, t in tensors.items():
        if nonfinite(t):
            raise AdapterError(f"{path}: tensor {PREFIX}{name} holds NaN or infinite values")
    return tensors, meta


def resolve_base(directory: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None,
                 cfg: Optional[AdapterConfig] = None) -> Path:
    """The base checkpoint of an adapter: `base` when given, else its base_model_name_or_path."""
    directory = Path(directory)
    if base is not None:
        tried = [Path(base).expanduser()]
    else:
        name = (cfg or read_adapter_config(directory)).base
        if not name:
            raise AdapterError(f"{directory / ADAPTER_CONFIG}: base_model_name_or_path: missing; give the base "
                               f"checkpoint with --base DIR")
        p = Path(name).expanduser()
        tried = [p] if p.is_absolute() else [directory / p, Path.cwd() / p]
    for p in tried:
        if (p / CONFIG).exists():
            return p
    raise AdapterError(f"{directory}: base checkpoint {' or '.join(map(str, tried))} not found (no {CONFIG}); "
                       f"give it with --base DIR")


def check_adapter(directory: Union[str, os.PathLike], base: Union[str, os.PathLike],
                  cfg: Optional[AdapterConfig] = None, infos: Optional[dict[str, TensorInfo]] = None,
                  meta: Optional[dict] = None) -> AdapterConfig:
    """Raise AdapterError unless the adapter fits the base: its config and tensor headers against the
    base's config.json alone (no weight is read). Returns the adapter config."""
    cfg = cfg or read_adapter_config(directory)
    if infos is None:
        infos, meta = read_adapter_header(directory)
    where, weights = f"adapter {directory}", Path(directory) / ADAPTER_WEIGHTS
    config = read_config(base)
    if meta and meta.get(_ARCH_KEY) and meta[_ARCH_KEY] != config.architecture:
        raise AdapterError(f"{where} was trained on a {meta[_ARCH_KEY]}, but base {base} is a {config.architecture}")
    with torch.device("meta"):
        layers = {n: m for n, m in CausalLM(config).named_modules() if isinstance(m, nn.Linear)}
    chosen = set(cfg.selects(sorted(layers)))
    if not chosen:
        names = sorted({n.rsplit(".", 1)[-1] for n in layers})
        raise AdapterError(f"{cfg.path}: target_modules: {_shown(cfg.raw.get('target_modules'))} selects no linear "
                           f"layer of base {base} (its linear layers: {', '.join(names)})")
    if isinstance(cfg.targets, tuple):
        present = set().union(*map(suffixes, layers))
        missing = sorted(set(cfg.targets) - present)
        if missing:
            names = sorted({n.rsplit(".", 1)[-1] for n in layers})
            raise AdapterError(f"{cfg.path}: target_modules: {_shown(missing)} do not exist in base {base} (its "
                               f"linear layers: {', '.join(names)})")
    if config.tie_word_embeddings and "lm_head" in chosen:
        raise AdapterError(f"{cfg.path}: target_modules selects lm_head, whose weight base {base} ties to its input "
                           f"embeddings: merging it would change them too")
    if not infos:
        raise AdapterError(f"{weights}: holds no tensors")
    for key, info in sorted(infos.items()):
        module, _, kind = key.rpartition(".lora_")
        layer = layers.get(module)
        if layer is None or kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"{where}: tensor {PREFIX}{key} names no linear layer of base {base}")
        if module not in chosen:
            raise AdapterError(f"{where}: tensor {PREFIX}{key} is for {module}, which target_modules does not select")
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterError(f"{weights}: tensor {PREFIX}{key} is {info.dtype}, not floating point")
        want = (cfg.r, layer.in_features) if kind == "A.weight" else (layer.out_features, cfg.r)
        if info.shape != want:
            raise AdapterError(f"{where}: tensor {PREFIX}{key} is {list(info.shape)}, but base {base} needs "
                               f"{list(want)} (r={cfg.r}, {layer.in_features} -> {layer.out_features})")
    lacking = [f"{PREFIX}{m}.lora_{k}.weight" for m in sorted(chosen) for k in "AB"
               if f"{m}.lora_{k}.weight" not in infos]
    if lacking:
        raise AdapterError(f"{weights}: {len(lacking)} tensor(s) of the modules target_modules selects are missing: "
                           f"{', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}")
    need, have = sum(i.numel for i in infos.values()) * 4, available_memory()
    if have is not None and need > have:
        raise AdapterError(f"{weights}: its tensors need {need / 2 ** 30:,.1f} GiB in float32 but the machine has "
                           f"{have / 2 ** 30:,.1f} GiB available")
    return cfg


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


def merge_adapter(model: CausalLM, cfg: AdapterConfig, tensors: dict[str, torch.Tensor]):
    """Add each adapter's scaled B @ A into its base weight (in place, no copy of the model); a merged
    weight that is not finite (an update too large for the weights' dtype) is refused by name."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            module = key[: -len(".lora_A.weight")]
            w = modules[module].weight
            merged = merge_weight(w, tensors[key].to(w.device), tensors[f"{module}.lora_B.weight"].to(w.device),
                                  cfg.scaling)
            if nonfinite(merged):
                raise AdapterError(f"{cfg.path}: merging the adapter of {module} (scaling {cfg.scaling:.4g}) gives "
                                   f"non-finite weights in {str(w.dtype)[6:]}")
            w.copy_(merged)


def load_checkpoint(path: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None,
                    dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu") -> CausalLM:
    """A plain checkpoint directory, or an adapter directory merged into its base (checked first); a .gguf
    file (as `path` or `base`) is its converted checkpoint (astrai.model.packaged.checkpoint_path)."""
    from astrai.model.packaged import checkpoint_path

    path, base = checkpoint_path(path), None if base is None else checkpoint_path(base)
    if not is_adapter(path):
        if base is not None:
            raise AdapterError(f"{path} is a full checkpoint, not an adapter directory: --base applies to adapters")
        return load_model(path, dtype=dtype, device=device)
    cfg = read_adapter_config(path)
    base_dir = resolve_base(path, base, cfg)
    infos, meta = read_adapter_header(path)
    check_adapter(path, base_dir, cfg, infos, meta)
    tensors, _ = read_adapter(path, infos)
    model = load_model(base_dir, dtype=dtype, device=device)
    merge_adapter(model, cfg, tensors)
    return model


def checkpoint_config(path: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None) -> ModelConfig:
    return read_config(resolve_base(path, base) if is_adapter(path) else path)


# ---- trainer checkpoints ----------------------------------------------------------------------

def save_weights(model: CausalLM, directory: Union[str, os.PathLike], state: Optional[dict] = None):
    """What a trainer checkpoint holds of the model: the whole model, or only its adapters."""
    if has_adapters(model):
        save_adapter(model, directory, state)
    else:
        save_model(model, directory, state)


def read_weights(directory: Union[str, os.PathLike], model: CausalLM) -> tuple[dict[str, torch.Tensor], bool]:
    """(the tensors to load into `model` under its own names, whether they are all of its state):
    a LoRA model gets its adapters (checked against its own layers), a plain one every tensor."""
    if not has_adapters(model):
        sd = read_tensors(directory)
        if model.config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd, True
    if not is_adapter(directory):
        raise AdapterError(f"{directory}: a full checkpoint, but this run trains LoRA adapters (remove the "
                           f"checkpoints of the earlier run, or train without lora)")
    tensors, _ = read_adapter(directory)
    want = {n: t.shape for n, t in model.state_dict().items() if n.endswith((".lora_A.weight", ".lora_B.weight"))}
    got = {n: t.shape for n, t in tensors.items()}
    if got != want:
        diff = sorted(set(got) ^ set(want)) or sorted(n for n in got if got[n] != want[n])
        raise AdapterError(f"{directory}: its adapters do not fit this run's (rank, target modules or base "
                           f"changed?): {diff[:3]}")
    return tensors, False
