"""The decoder shared by train and infer: families, config, RoPE, attention protocol, model, checkpoints.

Imports only torch, safetensors and json. See each module's docstring for its guarantees.
Names are loaded from their module on first use (PEP 562): `astrai.model.config` (the presets a
recipe is checked against) imports without torch, so checking or skipping a recipe never loads it.
"""

import importlib

_HOME = {
    **dict.fromkeys(("AttentionContext", "CausalContext", "causal_sdpa"), "attention"),
    **dict.fromkeys(("load_model", "read_config", "save_model"), "hf_checkpoint"),
    **dict.fromkeys(("FAMILIES", "PRESETS", "ModelConfig"), "config"),
    **dict.fromkeys(("config_from_hf", "config_to_hf"), "hf_config"),
    **dict.fromkeys(("Rotary", "apply_rotary", "inv_freq"), "rope"),
    **dict.fromkeys(("CausalLM", "load_balancing_loss"), "transformer"),
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'astrai.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"astrai.model.{_HOME[name]}"), name)
