"""The decoder shared by train and infer: families, config, RoPE, attention protocol, model, checkpoints.

Imports only torch, safetensors and json. See each module's docstring for its guarantees.
"""

from astrai.model.attention import AttentionContext, CausalContext, causal_sdpa
from astrai.model.config import FAMILIES, PRESETS, ModelConfig
from astrai.model.hf_checkpoint import load_model, read_config, save_model
from astrai.model.rope import Rotary, apply_rotary, inv_freq
from astrai.model.transformer import CausalLM, load_balancing_loss

__all__ = ["AttentionContext", "CausalContext", "CausalLM", "FAMILIES", "ModelConfig", "PRESETS", "Rotary",
           "apply_rotary", "causal_sdpa", "inv_freq", "load_balancing_loss", "load_model", "read_config", "save_model"]
