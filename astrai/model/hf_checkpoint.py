"""Model checkpoints as Hugging Face writes them: config.json + model.safetensors (or shards).

`save_model(model, dir[, state])` writes config.json (the family's own architecture and keys,
astrai.model.hf_config) and model.safetensors (from `state` when the full state dict was gathered
from a sharded model), each under a temporary name and renamed, so a kill mid-save leaves the
previous files or none, never a torn one. A tied LM head is stored once (as embed_tokens, like HF).

`load_model(dir, dtype=...)` treats the directory as untrusted input and checks, in this order and
before allocating anything: config.json's values (astrai.model.hf_config), the safetensors headers
(astrai.model.checkpoint_files: regular files only, lengths, offsets, an index that stays inside the
directory, no pickle ever opened), the tensors against what the config implies (layer count,
missing / unexpected names, shapes, dtypes: astrai.model.weights), and the weights' size against
the machine's available memory. Then it builds the model on the meta device and assigns the
tensors (each checked finite), so nothing is initialised twice and a model is held in memory once.
It reads a single file or a sharded checkpoint, in the family's layout or transformers 5's fused
MoE layout. Every refusal is one ModelFileError naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from astrai.errors import ModelFileError
from astrai.model.checkpoint_files import CONFIG, INDEX, WEIGHTS, read_headers, read_json
from astrai.model.config import ModelConfig
from astrai.model.hf_config import config_from_hf, config_to_hf
from astrai.model.transformer import CausalLM
from astrai.runtime import atomic_write_text, fresh_tmp, fsync_replace
from astrai.model.weights import (IGNORED_SUFFIXES, available_memory, check_tensors, nonfinite, split_tensor,
                                  torch_dtype, unfuse_experts)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}

__all__ = ["CONFIG", "INDEX", "WEIGHTS", "load_model", "model_state", "read_config", "read_tensors", "save_model"]


def model_state(model: CausalLM, state: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """The tensors as written to disk: HF names, a tied lm_head dropped, contiguous, on CPU.
    `state`: the model's full state dict when it was gathered elsewhere (a sharded model)."""
    state = model.state_dict() if state is None else state
    sd = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_model(model: CausalLM, directory: Union[str, os.PathLike], state: Optional[dict] = None) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sd = model_state(model, state)
    dtype = next(iter(sd.values())).dtype
    weights = out / WEIGHTS
    tmp = fresh_tmp(weights)
    save_file(sd, str(tmp), metadata={"format": "pt"})
    fsync_replace(tmp, weights)
    (out / INDEX).unlink(missing_ok=True)  # a stale shard index would shadow the single file
    hf = config_to_hf(model.config)
    hf["torch_dtype"] = _DTYPE_NAMES.get(dtype, "float32")
    if "dtype" in hf:
        hf["dtype"] = hf["torch_dtype"]
    cfg = out / CONFIG
    atomic_write_text(cfg, json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out


def read_config(directory: Union[str, os.PathLike]) -> ModelConfig:
    d = Path(directory)
    if not d.exists():
        raise ModelFileError(f"{d}: no such file or directory (give a checkpoint directory: config.json + "
                             f"model.safetensors)")
    if not d.is_dir():
        raise ModelFileError(f"{d}: not a checkpoint directory (config.json + model.safetensors)")
    if not (d / CONFIG).exists():
        raise ModelFileError(f"{d / CONFIG}: no config.json; expected a Hugging Face model directory")
    return config_from_hf(read_json(d / CONFIG, "config.json"), str(d / CONFIG))


def _read(headers: dict, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of already-checked headers, read file by file."""
    by_file: dict[Path, list[str]] = {}
    for name, info in headers.items():
        if keep(name):
            by_file.setdefault(info.file, []).append(name)
    out = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelFileError(f"{path}: cannot read its tensors: {e}") from None
    return out


def read_tensors(directory: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, as stored (the files checked first)."""
    return _read(read_headers(directory))


def load_model(directory: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
               device: Union[str, torch.device] = "cpu") -> CausalLM:
    """A CausalLM from an HF-style directory. dtype None keeps the stored dtype (float32 when mixed)."""
    source = str(directory)
    config = read_config(directory)
    headers = read_headers(directory)
    check_tensors(config, headers, source)
    stored = {torch_dtype(i.dtype) for i in headers.values()}
    dtype = dtype or (stored.pop() if len(stored) == 1 else torch.float32)
    need = sum(i.numel for i in headers.values()) * torch.empty((), dtype=dtype).element_size()
    have = available_memory()
    if have is not None and need > have:
        raise ModelFileError(f"{source}: the weights need {need / 2 ** 30:,.1f} GiB as {str(dtype)[6:]} but the "
                             f"machine has {have / 2 ** 30:,.1f} GiB available")
    tied = config.tie_word_embeddings
    sd = _read(headers, lambda n: not n.endswith(IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight"))
    sd = unfuse_experts(sd, config, split_tensor)
    for name, t in sd.items():
        if nonfinite(t):
            raise ModelFileError(f"{headers.get(name, next(iter(headers.values()))).file}: tensor {name!r} holds "
                                 f"NaN or infinite values")
    with torch.device("meta"):
        model = CausalLM(config)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=False, assign=True)  # names already checked (a tied head is absent)
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelFileError(f"{source}: no weights were read for {left[:4]}")
    return model


def model_state_names(model: CausalLM) -> list[str]:
    names = list(model.state_dict().keys())
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names
