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
tensors (each checked finite) one decoder layer at a time, so nothing is initialised twice and a
model is held in memory once. With `quantize` (QLoRA's NF4 base), each decoder projection is
quantized as its layer is read and the full-precision copy dropped before the next layer: the
full-precision base is never held whole. Tensors are read with plain reads at the offsets of the
checked header, never through a memory map (whose pages would stay resident while any tensor of the
file lives).
It reads a single file or a sharded checkpoint, in the family's layout or transformers 5's fused
MoE layout. Every refusal is one ModelFileError naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors.torch import save_file

from astrai.errors import ModelFileError, open_regular
from astrai.model.checkpoint_files import CONFIG, INDEX, WEIGHTS, TensorInfo, read_headers, read_json
from astrai.model.config import ModelConfig
from astrai.model.hf_config import config_from_hf, config_to_hf
from astrai.model.transformer import CausalLM
from astrai.runtime import atomic_write_text, fresh_tmp, fsync_replace
from astrai.model.weights import (IGNORED_SUFFIXES, available_memory, check_tensors, nonfinite, split_tensor,
                                  torch_dtype, unfuse_experts)

_STORED = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

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
    """The tensors of already-checked headers, read file by file into memory of their own: plain reads at
    the offsets the checked header gives, not a memory map, whose pages would count in the process's
    resident memory for as long as any tensor viewing the file lives (one small norm weight would keep a
    whole shard's pages resident)."""
    by_file: dict[Path, list[str]] = {}
    for name, info in headers.items():
        if keep(name):
            by_file.setdefault(info.file, []).append(name)
    out = {}
    for path, names in by_file.items():
        try:
            with open_regular(path, "rb", "weights file", error=ModelFileError) as f:
                for name in sorted(names, key=lambda n: headers[n].offset):
                    out[name] = _read_one(f, headers[name])
        except OSError as e:
            raise ModelFileError(f"{path}: cannot read its tensors: {e}") from None
    return out


def _read_one(f, info: TensorInfo) -> torch.Tensor:
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    f.seek(info.offset)
    if f.readinto(buf.numpy()) != info.nbytes:
        raise ModelFileError(f"{info.file}: tensor {info.name!r}: the file ends before its bytes (changed while "
                             f"being read)")
    return buf.view(_STORED[info.dtype]).reshape(info.shape)  # safetensors: little-endian, as torch on this CPU


def read_tensors(directory: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, as stored (the files checked first)."""
    return _read(read_headers(directory))


def load_model(directory: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
               device: Union[str, torch.device] = "cpu", quantize: Optional[str] = None,
               quantize_modules: tuple[str, ...] = ()) -> CausalLM:
    """A CausalLM from an HF-style directory. dtype None keeps the stored dtype (float32 when mixed).
    `quantize` (nf4, int8, int4; astrai.model.quant): every decoder projection whose own name is in
    `quantize_modules` is quantized as it is read (embeddings, norms and the LM head stay in `dtype`)."""
    source = str(directory)
    config = read_config(directory)
    headers = read_headers(directory)
    shapes = check_tensors(config, headers, source)
    stored = {torch_dtype(i.dtype) for i in headers.values()}
    dtype = dtype or (stored.pop() if len(stored) == 1 else torch.float32)
    quantized = {n: s for n, s in shapes.items() if quantize and _quantized(n, s, quantize_modules)}
    if quantize:
        from astrai.model.quant import check_quantizable

        check_quantizable(quantized, quantize)  # a size that does not divide the block: before any read
    need = _bytes_needed(shapes, quantized, quantize, torch.empty((), dtype=dtype).element_size())
    have = available_memory()
    if have is not None and need > have:
        raise ModelFileError(f"{source}: the weights need {need / 2 ** 30:,.1f} GiB as {str(dtype)[6:]} but the "
                             f"machine has {have / 2 ** 30:,.1f} GiB available")
    tied = config.tie_word_embeddings
    wanted = {n: i for n, i in headers.items()
              if not n.endswith(IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight")}
    with torch.device("meta"):
        model = CausalLM(config)
    for group in _layer_groups(wanted):  # one decoder layer's tensors at a time: never the whole model twice
        sd = unfuse_experts(_read(group), config, split_tensor)
        for name, t in sd.items():
            if nonfinite(t):
                raise ModelFileError(f"{headers.get(name, next(iter(group.values()))).file}: tensor {name!r} "
                                     f"holds NaN or infinite values")
        sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
        for name in [n for n in sd if n in quantized]:
            _put_quantized(model, name[:-len(".weight")], sd, quantize)
        model.load_state_dict(sd, strict=False, assign=True)  # names already checked (a tied head is absent)
        del sd
        if quantize:
            _trim_heap()
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelFileError(f"{source}: no weights were read for {left[:4]}")
    return model


def _trim_heap():
    """Give the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Quantizing a
    layer frees its full-precision weight and the quantizer's temporaries, megabytes each, which glibc
    keeps in holes between the small quantized tensors that outlive them; without this the resident
    memory grows by most of a float32 layer per layer read, as if the float32 base were held after all."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _quantized(name: str, shape: tuple, modules: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in modules and len(shape) == 2


def _bytes_needed(shapes: dict, quantized: dict, kind: Optional[str], item: int) -> int:
    from math import prod

    from astrai.model.quant import bytes_per_weight

    full = sum(prod(s) for n, s in shapes.items() if n not in quantized) * item
    return full + int(sum(prod(s) for s in quantized.values()) * (bytes_per_weight(kind, item) if kind else item))


def _layer_groups(headers: dict) -> list[dict]:
    """The headers split by decoder layer (model.layers.N.*), the tensors outside the layers first."""
    groups: dict[int, dict] = {}
    for name, info in headers.items():
        m = _LAYER.match(name)
        groups.setdefault(int(m.group(1)) if m else -1, {})[name] = info
    return [groups[k] for k in sorted(groups)]


def _put_quantized(model: CausalLM, module: str, sd: dict, kind: str):
    """Replace the (meta) linear `module` by its quantized layer built from sd's weight (and bias), which
    are taken out of sd: the full-precision weight is dropped as soon as it is quantized."""
    from astrai.model.quant import quantize_weight

    parent, _, child = module.rpartition(".")
    layer = quantize_weight(sd.pop(f"{module}.weight"), sd.pop(f"{module}.bias", None), kind, module)
    setattr(model.get_submodule(parent), child, layer)


def model_state_names(model: CausalLM) -> list[str]:
    names = list(model.state_dict().keys())
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names
