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
adapters into it (W + alpha/r * B @ A; `use_rslora` adapters: alpha/sqrt(r)). Everything the
adapter needs from the base is checked first, against the base's config.json alone, and a
mismatch is one line (AdapterError): another architecture, a target module the base lacks, a
tensor whose shape does not fit the base's layer, a PEFT feature we do not compute (DoRA, biases,
per-module ranks, modules_to_save).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from astrai.model.config import ModelConfig
from astrai.model.hf_checkpoint import CONFIG, load_model, read_config, read_tensors, save_model
from astrai.runtime import atomic_write_text, fresh_tmp, fsync_replace
from astrai.model.lora import Adapter, adapter_state, has_adapters, merge_weight
from astrai.model.transformer import CausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_ARCH_KEY = "astrai.base_architecture"


class AdapterError(ValueError):
    """An adapter that cannot be applied to the base it was given (one line: what and where)."""


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
    arch = (model.config.to_hf().get("architectures") or [""])[0]
    weights = out / ADAPTER_WEIGHTS
    tmp = fresh_tmp(weights)
    save_file(tensors, str(tmp), metadata={"format": "pt", _ARCH_KEY: arch})
    fsync_replace(tmp, weights)
    atomic_write_text(out / ADAPTER_CONFIG, json.dumps(peft_config(model.adapter), indent=2, sort_keys=True) + "\n")
    return out


# ---- reading ----------------------------------------------------------------------------------

def read_adapter_config(directory: Union[str, os.PathLike]) -> dict:
    path = Path(directory) / ADAPTER_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not a readable adapter config ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    return cfg


def read_adapter(directory: Union[str, os.PathLike]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors under the model's own names, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight`;
    the file's metadata)."""
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.exists():
        raise AdapterError(f"{directory}: {ADAPTER_CONFIG} without {ADAPTER_WEIGHTS} (a pickled adapter_model.bin "
                           f"is never loaded)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {}
        for key in f.keys():
            name = key[len(PREFIX):] if key.startswith(PREFIX) else key
            name = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name)  # `.lora_A.default.weight`
            tensors[name] = f.get_tensor(key)
    return tensors, meta


def scaling_of(cfg: dict) -> float:
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def resolve_base(directory: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The base checkpoint of an adapter: `base` when given, else its base_model_name_or_path."""
    directory = Path(directory)
    if base is not None:
        tried = [Path(base).expanduser()]
    else:
        name = read_adapter_config(directory).get("base_model_name_or_path")
        if not name:
            raise AdapterError(f"{directory}: {ADAPTER_CONFIG} names no base_model_name_or_path; give the base "
                               f"checkpoint with --base DIR")
        p = Path(name).expanduser()
        tried = [p] if p.is_absolute() else [directory / p, Path.cwd() / p]
    for p in tried:
        if (p / CONFIG).exists():
            return p
    raise AdapterError(f"{directory}: base checkpoint {' or '.join(map(str, tried))} not found (no {CONFIG}); "
                       f"give it with --base DIR")


_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "layers_to_transform": "layers_to_transform",
                "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out",
                "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters"}


def check_adapter(directory: Union[str, os.PathLike], base: Union[str, os.PathLike],
                  tensors: Optional[dict] = None, meta: Optional[dict] = None) -> dict:
    """Raise AdapterError unless the adapter fits the base (read from its config.json alone: no
    weights are loaded). Returns the adapter config."""
    cfg = read_adapter_config(directory)
    where = f"adapter {directory}"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(f"{where}: uses {what}, which astrai does not compute")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise AdapterError(f"{where}: trains biases (bias: {cfg.get('bias')!r}), which astrai does not compute")
    if tensors is None:
        tensors, meta = read_adapter(directory)
    config = read_config(base)
    arch = (json.loads((Path(base) / CONFIG).read_text()).get("architectures") or [""])[0]
    if meta and meta.get(_ARCH_KEY) and arch and meta[_ARCH_KEY] != arch:
        raise AdapterError(f"{where} was trained on a {meta[_ARCH_KEY]}, but base {base} is a {arch}")
    with torch.device("meta"):
        layers = {n: m for n, m in CausalLM(config).named_modules() if isinstance(m, nn.Linear)}
    names = {n.rsplit(".", 1)[-1] for n in layers}
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):  # PEFT: a regex over the full module name
        if not any(re.fullmatch(targets, n) for n in layers):
            raise AdapterError(f"{where}: target_modules {targets!r} matches no linear layer of base {base}")
    else:
        missing = sorted(set(targets) - names)
        if missing:
            raise AdapterError(f"{where}: target modules {missing} do not exist in base {base} (its linear layers: "
                               f"{', '.join(sorted(names))})")
    if not tensors:
        raise AdapterError(f"{where}: {ADAPTER_WEIGHTS} holds no tensors")
    r = cfg.get("r")
    for key, t in sorted(tensors.items()):
        module, _, kind = key.rpartition(".lora_")
        layer = layers.get(module)
        if layer is None or kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"{where}: tensor {PREFIX}{key} names no linear layer of base {base}")
        want = (r, layer.in_features) if kind == "A.weight" else (layer.out_features, r)
        if tuple(t.shape) != want:
            raise AdapterError(f"{where}: tensor {PREFIX}{key} is {list(t.shape)}, but base {base} needs {list(want)} "
                               f"(r={r}, {layer.in_features} -> {layer.out_features})")
    return cfg


def merge_adapter(model: CausalLM, cfg: dict, tensors: dict[str, torch.Tensor]):
    """Add each adapter's scaled B @ A into its base weight (in place, no copy of the model)."""
    scaling = scaling_of(cfg)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            module = key[: -len(".lora_A.weight")]
            w = modules[module].weight
            w.copy_(merge_weight(w, tensors[key].to(w.device), tensors[f"{module}.lora_B.weight"].to(w.device), scaling))


def load_checkpoint(path: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None,
                    dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu") -> CausalLM:
    """A plain checkpoint directory, or an adapter directory merged into its base (checked first)."""
    if not is_adapter(path):
        if base is not None:
            raise AdapterError(f"{path} is a full checkpoint, not an adapter directory: --base applies to adapters")
        return load_model(path, dtype=dtype, device=device)
    base_dir = resolve_base(path, base)
    tensors, meta = read_adapter(path)
    cfg = check_adapter(path, base_dir, tensors, meta)
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
