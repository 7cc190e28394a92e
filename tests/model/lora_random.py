"""A LoRA model with random, non-zero A and B on a saved base, as after some training (shared by the LoRA tests)."""

import torch

from astrai.model import load_model
from astrai.model.lora import LoraSpec, apply_lora, lora_layers


def random_adapter(path, spec=LoraSpec(4, 8.0), seed=1, std=0.05):
    """The base at `path` with `spec`'s adapters applied, B drawn from N(0, std) (A as apply_lora draws it)."""
    model = load_model(path)
    torch.manual_seed(seed)
    apply_lora(model, spec, base=str(path))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, std)
    return model.eval()
