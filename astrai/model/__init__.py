"""The decoder shared by train and infer: config, RoPE, attention protocol, model, checkpoints.

Imports only torch, safetensors and json. See each module's docstring for its guarantees.

Every torch path of astrai (train, infer) imports this package first, so the torch floor is
checked here, once, with a message instead of an AttributeError deep in a step: torch >= 2.6
(TORCH_FLOOR; pyproject.toml states the same, a test keeps them equal), for
scaled_dot_product_attention(enable_gqa=...) (2.5) and the public FSDP2 `fully_shard` (2.6).
"""

import re

import torch

TORCH_FLOOR = (2, 6)


def check_torch_version(version: str = torch.__version__) -> None:
    found = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"astrai needs torch >= {floor} (scaled_dot_product_attention's enable_gqa, 2.5; "
                          f"torch.distributed.fsdp.fully_shard, 2.6), found {version}: pip install 'torch>={floor}'")


check_torch_version()

# after the version check, so an old torch gets the message rather than an error from these imports
from astrai.model.attention import AttentionContext, CausalContext, causal_sdpa  # noqa: E402
from astrai.model.hf_checkpoint import load_model, read_config, save_model  # noqa: E402
from astrai.model.config import PRESETS, ModelConfig  # noqa: E402
from astrai.model.rope import Rotary, apply_rotary, inv_freq  # noqa: E402
from astrai.model.transformer import CausalLM, load_balancing_loss  # noqa: E402

__all__ = ["AttentionContext", "CausalContext", "CausalLM", "ModelConfig", "PRESETS", "Rotary", "apply_rotary",
           "causal_sdpa", "inv_freq", "load_balancing_loss", "load_model", "read_config", "save_model"]
