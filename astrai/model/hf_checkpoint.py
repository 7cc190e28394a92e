"""Model checkpoints as Hugging Face writes them: config.json + model.safetensors (or shards).

`save_model(model, dir[, state])` writes config.json and model.safetensors (from `state` when the
full state dict was gathered from a sharded model), each under a temporary name and
renamed, so a kill mid-save leaves the previous files or none, never a torn one. A tied LM head is
stored once (as embed_tokens, like HF). `load_model(dir, dtype=...)` reads a single file or a
sharded checkpoint with model.safetensors.index.json, in our layout or in transformers 5's fused
MoE layout (experts.gate_up_proj / experts.down_proj), builds the model on the meta device and
assigns the tensors, so nothing is initialised twice and a model is held in memory once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_replace(tmp: Path, path: Path):
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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
    save_file(sd, str(_tmp(weights)), metadata={"format": "pt"})
    _fsync_replace(_tmp(weights), weights)
    (out / INDEX).unlink(missing_ok=True)  # a stale shard index would shadow the single file
    hf = model.config.to_hf()
    hf["torch_dtype"] = _DTYPE_NAMES.get(dtype, "float32")
    cfg = out / CONFIG
    _tmp(cfg).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    _fsync_replace(_tmp(cfg), cfg)
    return out


def read_config(directory: Union[str, os.PathLike]) -> ModelConfig:
    path = Path(directory) / CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face model directory")
    return ModelConfig.from_hf(json.loads(path.read_text()))


def read_tensors(directory: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    d = Path(directory)
    if (d / INDEX).exists():
        files = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
    elif (d / WEIGHTS).exists():
        files = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{d}: neither {WEIGHTS} nor {INDEX}")
    tensors = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _unfuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 may store Mixtral experts fused: mlp.experts.gate_up_proj [E, 2I, H] and
    mlp.experts.down_proj [E, H, I]; ours are per expert under block_sparse_moe (the Hub layout)."""
    out = {}
    for key, t in sd.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            base = key[: -len(".mlp.experts.gate_up_proj")] + ".block_sparse_moe.experts"
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = gate[e], up[e]
        elif key.endswith(".mlp.experts.down_proj"):
            base = key[: -len(".mlp.experts.down_proj")] + ".block_sparse_moe.experts"
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w2.weight"] = t[e]
        elif ".mlp.gate.weight" in key and "block_sparse_moe" not in key and "experts" not in key:
            out[key.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t
        else:
            out[key] = t
    return out


def load_model(directory: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
               device: Union[str, torch.device] = "cpu") -> CausalLM:
    """A CausalLM from an HF-style directory. dtype None keeps the stored dtype."""
    config = read_config(directory)
    sd = read_tensors(directory)
    if config.is_moe:
        sd = _unfuse_experts(sd)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = set(model_state_names(model))
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise ValueError(f"{directory}: checkpoint does not match its config.json: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    sd = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    return model


def model_state_names(model: CausalLM) -> list[str]:
    names = list(model.state_dict().keys())
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names
