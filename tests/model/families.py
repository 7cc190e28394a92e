"""Tiny random-weight models of every family, written by transformers itself (tests/model/test_families.py).

Shapes are chosen so that every feature a family has is exercised: three or four layers, grouped-query
attention, a sliding window (8) shorter than the prompts, biases, both Gemma layer types with their own
RoPE bases, a softmax scale other than 1/sqrt(head_dim), final logit soft-capping, rope scaling, dense and
sparse MoE layers. Weights are larger than the init scale so a wrong norm, rotation, window or routing
shows up far above 1e-4.
"""

from __future__ import annotations

import torch

WINDOW = 8
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)

# family -> (transformers config class name, its kwargs beyond COMMON)
CASES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, rope_theta=5000.0)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(attention_bias=True, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=2, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "gemma3_text": ("Gemma3TextConfig", dict(num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=2,
                                             query_pre_attn_scalar=32, rope_theta=20000.0, rope_local_base_freq=500.0,
                                             final_logit_softcapping=5.0,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=False, mlp_only_layers=[1], rope_theta=30000.0)),
}
SLIDING = {"mistral", "qwen2", "qwen3", "gemma3_text", "mixtral"}


def hf_config(family: str, **overrides):
    import transformers

    cls_name, kwargs = CASES[family]
    return getattr(transformers, cls_name)(**{**COMMON, **kwargs, **overrides})


def randomize(module: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if "norm" in name:  # Gemma's (1 + w) norms centre on 0, the others on 1
                centre = 0.0 if "Gemma" in type(module).__name__ else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + centre)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "embed" in name else 0.08))


def hf_model(family: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides)).float().eval()
    randomize(model, seed + 1)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
