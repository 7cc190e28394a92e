"""adapter_config.json (PEFT's LoraConfig) read as untrusted input: every value astrai uses is checked.

`read_adapter_config(dir)` reads the file through astrai.json_bounded (a regular file of at most
MAX_CONFIG_BYTES, nested at most a few levels) and returns an AdapterConfig, or raises AdapterError
naming the file and the key:
  r               a positive integer (not a bool, not 8.0, at most MAX_RANK)
  lora_alpha      a finite number (not a string, not a bool)
  use_rslora      true or false; the scaling alpha / r (alpha / sqrt(r) with rslora) must be finite
                  and at most MAX_SCALING in size: a larger one turns any trained update into
                  infinities, or the base's weights into noise
  target_modules  a list of module names (a name selects a module named so, or ending in "." + it)
                  or one regular expression over the full module name (astrai.model.target_regex:
                  matched in bounded time), as PEFT reads them
  exclude_modules the same shapes, taken out of the selection
  peft_type       LORA; task_type CAUSAL_LM (or absent)
PEFT keys that change what the adapter computes, and that astrai does not compute, are refused
when set (UNMODELLED); keys that only matter to training or initialisation are read and ignored
(INERT); a key neither list knows is refused unless empty (null, false, {}, []): a newer PEFT
option set to a value may change the computation, and guessing would merge something else.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from astrai import json_bounded
from astrai.errors import ModelFileError
from astrai.model.target_regex import TargetPattern

ADAPTER_CONFIG = "adapter_config.json"
MAX_CONFIG_BYTES = 4 << 20
MAX_RANK = 1 << 16
MAX_SCALING = 1e4  # alpha / r of real adapters is 0.25..64; rslora's alpha / sqrt(r) a few hundred at most


class AdapterError(ModelFileError):
    """An adapter that cannot be read or applied to the base it was given (one line: what and where)."""


UNMODELLED = {
    "use_dora": "DoRA", "modules_to_save": "modules_to_save (whole trained modules)",
    "layers_to_transform": "layers_to_transform", "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)", "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
    "trainable_token_indices": "trainable token embeddings", "target_parameters": "adapters on parameters",
    "lora_bias": "a bias on lora_B", "layer_replication": "layer replication", "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA sampling",
    "megatron_config": "Megatron parallel layers",
}
INERT = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "lora_dropout",
    "init_lora_weights", "auto_mapping", "peft_version", "layers_pattern", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "velora_config", "qalora_group_size", "megatron_core",
    "ensure_weight_tying", "runtime_config", "r", "lora_alpha", "use_rslora", "target_modules",
    "exclude_modules", "bias",
})


def _empty(v) -> bool:
    return v is None or v is False or v == {} or v == [] or v == ""


@dataclass(frozen=True)
class AdapterConfig:
    path: Path
    r: int
    alpha: float
    rslora: bool
    targets: Union[tuple, TargetPattern]
    exclude: Union[tuple, TargetPattern, None]
    base: Optional[str]  # base_model_name_or_path
    raw: dict

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    def selects(self, names: list[str]) -> list[str]:
        """The module names PEFT would wrap (peft.tuners.tuners_utils.check_target_module_exists)."""
        chosen = _matching(self.targets, names)
        if self.exclude is not None:
            excluded = set(_matching(self.exclude, names))
            chosen = [n for n in chosen if n not in excluded]
        return chosen


def suffixes(name: str) -> set[str]:
    """"a.b.c" -> {"a.b.c", "b.c", "c"}: what a listed name must equal to select the module."""
    parts = name.split(".")
    return {".".join(parts[i:]) for i in range(len(parts))}


def _matching(spec, names: list[str]) -> list[str]:
    if isinstance(spec, TargetPattern):
        return spec.select(names)
    wanted = set(spec)
    return [n for n in names if suffixes(n) & wanted]


def _fail(path: Path, key: str, why: str):
    raise AdapterError(f"{path}: {key}: {why}")


def _modules(path: Path, key: str, v, required: bool):
    """A list of names, or a regular expression, as PEFT accepts for target_modules / exclude_modules."""
    if v is None or v == [] and not required:
        if required:
            _fail(path, key, "missing: name the adapted modules (a list, or a regular expression)")
        return None
    if isinstance(v, str):
        try:
            return TargetPattern(v)
        except ValueError as e:
            _fail(path, key, str(e))
    if not isinstance(v, list) or not v or not all(isinstance(n, str) and n for n in v):
        _fail(path, key, f"must be a list of module names or one regular expression, got {v!r}"[:300])
    return tuple(v)


def check_adapter_config(cfg, path: Path) -> AdapterConfig:
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        _fail(path, "peft_type", f"{cfg.get('peft_type')!r}; only LORA adapters are supported")
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        _fail(path, "task_type", f"{cfg['task_type']!r}; astrai applies adapters of causal language models "
                                 f"(CAUSAL_LM)")
    for key, v in cfg.items():
        if key in UNMODELLED and not _empty(v):
            _fail(path, key, f"{v!r}: {UNMODELLED[key]} changes what the adapter computes, and astrai does not "
                             f"compute it"[:400])
        if key not in UNMODELLED and key not in INERT and not _empty(v):
            _fail(path, key, f"{v!r}: an option astrai does not know; it may change what the adapter computes, "
                             f"so the adapter is not applied"[:400])
    if cfg.get("bias", "none") != "none":
        _fail(path, "bias", f"{cfg['bias']!r}: the adapter trains biases, which astrai does not compute")
    r = cfg.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_RANK:
        _fail(path, "r", f"must be an integer in 1..{MAX_RANK}, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        _fail(path, "lora_alpha", f"must be a finite number, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        _fail(path, "use_rslora", f"must be true or false, got {rslora!r}")
    base = cfg.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        _fail(path, "base_model_name_or_path", f"must be a path, got {base!r}")
    targets = _modules(path, "target_modules", cfg.get("target_modules"), True)
    exclude = _modules(path, "exclude_modules", cfg.get("exclude_modules"), False)
    out = AdapterConfig(path, r, float(alpha), rslora, targets, exclude, base or None, cfg)
    key = "lora_alpha / sqrt(r)" if rslora else "lora_alpha / r"
    if not abs(out.scaling) <= MAX_SCALING:
        _fail(path, "lora_alpha", f"{alpha!r} with r {r}: the scaling {key} = {out.scaling:.4g} is beyond "
                                  f"{MAX_SCALING:g}; no trained adapter scales its update so far")
    return out


def read_adapter_config(directory: Union[str, os.PathLike]) -> AdapterConfig:
    path = Path(directory) / ADAPTER_CONFIG
    cfg = json_bounded.read_json(path, "adapter config", MAX_CONFIG_BYTES, error=AdapterError)
    return check_adapter_config(cfg, path)
