"""Several LoRA adapters served side by side on one base, requests for different adapters batched in
one step.

An `AdapterBank` holds n adapters (PEFT directories trained on the engine's base, each checked
against it by astrai.model.adapter_files.check_adapter before a tensor is read) in the engine's
dtype, per layer and per packed projection group:

    qkv      q_proj, k_proj, v_proj      o        o_proj
    gate_up  gate_proj, up_proj          down     down_proj

For a group of projections p, with r the largest rank of the adapters:

    a_t  [in, len(p) * n * r]       column block (p, j) = A_j(p)^T of adapter j (zero where adapter j
                                    does not adapt p, or past its own rank)
    b_t  [len(p) * n * r, sum out]  block-diagonal over p; row block (p, j) = scaling_j * B_j(p)^T

A step whose tokens belong to requests of different adapters (0 = the base) computes, for a
projection group's input h [T, in] and its output y = h @ W (the packed base weights),

    y + ((h @ a_t) * mask) @ b_t,     mask [T, len(p) * n * r] = 1 on the token's adapter's blocks

so a token's low-rank term is exactly its own adapter's (the other blocks multiply by 0 and add
0), the whole batch in two matmuls per group whatever the mix of adapters (rank n * r columns:
small next to the base's). The result equals the adapter merged into the base (W + s B A, as
`load_checkpoint` serves one adapter) up to the rounding of the two ways of summing. Steps
without adapter tokens run the plain forward and pay nothing.

Adapters may target the attention and dense MLP projections; the LM head, the embeddings and
experts are refused by name (their products are not in these groups).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from astrai.model.adapter_config import AdapterError, read_adapter_config
from astrai.model.adapter_files import check_adapter, read_adapter, read_adapter_header

GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
_SERVED = {p for ps in GROUPS.values() for p in ps}  # module paths inside a decoder layer


@dataclass
class LowRank:
    a_t: torch.Tensor  # [in, groups * n * r]
    b_t: torch.Tensor  # [groups * n * r, out]
    reps: int  # projections in the group


class AdapterBank:
    def __init__(self, names: list[str], ranks: list[int], layers: list[dict[str, LowRank]]):
        self.names = names
        self.index = {name: i + 1 for i, name in enumerate(names)}  # 0: the base
        self.r = max(ranks)
        self.layers = layers

    @staticmethod
    def check(adapters: dict[str, Union[str, os.PathLike]], base_dir: Union[str, os.PathLike]) -> list:
        """Each adapter's (config, tensor headers), checked against the base's config and the projections a
        bank serves before any weight is read; AdapterError names the adapter and the module."""
        checked = []
        for name, directory in adapters.items():
            cfg = read_adapter_config(directory)
            infos, meta = read_adapter_header(directory)
            check_adapter(directory, base_dir, cfg, infos, meta)
            for key in infos:
                module = key.rpartition(".lora_")[0]
                parts = module.split(".", 3)  # model, layers, index, path inside the layer
                if not (len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _SERVED):
                    raise AdapterError(f"adapter {name} ({directory}): {module} is not served beside other adapters "
                                       f"(q/k/v/o and the dense MLP's gate/up/down are); merge it alone instead")
            checked.append((cfg, infos))
        return checked

    @classmethod
    def load(cls, adapters: dict[str, Union[str, os.PathLike]], base_dir: Union[str, os.PathLike], model,
             dtype: torch.dtype, device: torch.device, checked: Optional[list] = None) -> "AdapterBank":
        """The bank of `adapters` (name -> PEFT adapter directory) for `model`, loaded from `base_dir`;
        `checked`: what `check` returned for them, when it already ran."""
        checked = checked if checked is not None else cls.check(adapters, base_dir)
        configs = [cfg for cfg, _ in checked]
        tensors = [read_adapter(directory, infos)[0] for directory, (_, infos) in zip(adapters.values(), checked)]
        n, r = len(configs), max(c.r for c in configs)
        layers = []
        for i, layer in enumerate(model.model.layers):
            groups = {}
            for group, projs in GROUPS.items():
                mods = [layer.get_submodule(p) if _has(layer, p) else None for p in projs]
                keys = [f"model.layers.{i}.{p}" for p in projs]
                if not any(f"{k}.lora_A.weight" in t for k in keys for t in tensors):
                    continue
                a_t = torch.zeros(mods[0].in_features, len(projs) * n * r, dtype=torch.float32)
                b_t = torch.zeros(len(projs) * n * r, sum(m.out_features for m in mods), dtype=torch.float32)
                col = 0
                for pi, (m, key) in enumerate(zip(mods, keys)):
                    for j, (cfg, t) in enumerate(zip(configs, tensors)):
                        a, b = t.get(f"{key}.lora_A.weight"), t.get(f"{key}.lora_B.weight")
                        if a is None:
                            continue
                        rows = slice((pi * n + j) * r, (pi * n + j) * r + cfg.r)
                        a_t[:, rows] = a.float().t()
                        b_t[rows, col:col + m.out_features] = cfg.scaling * b.float().t()
                    col += m.out_features
                groups[group] = LowRank(a_t.to(device=device, dtype=dtype), b_t.to(device=device, dtype=dtype),
                                        len(projs))
            layers.append(groups)
        return cls(list(adapters), [c.r for c in configs], layers)

    def adapter_id(self, name: Optional[str]) -> int:
        """0 for the base (None), the adapter's index otherwise; KeyError for a name the bank lacks."""
        return 0 if name is None else self.index[name]

    def token_mask(self, adapter_ids: list[int], q_lens: list[int], dtype: torch.dtype,
                   device: torch.device) -> dict[int, torch.Tensor]:
        """{k: [T, k * n * r]} for the group sizes k: 1 on the r columns of each token's adapter in each of
        the k blocks (none for the base's tokens); made once per step, read by every layer."""
        per_token = torch.tensor([a for a, q in zip(adapter_ids, q_lens) for _ in range(q)], device=device)
        onehot = (per_token[:, None] == torch.arange(1, len(self.names) + 1, device=device)).to(dtype)
        mask = onehot.repeat_interleave(self.r, dim=1)
        return {k: mask if k == 1 else mask.repeat(1, k) for k in {len(p) for p in GROUPS.values()}}

    def delta(self, layer: int, group: str, h: torch.Tensor, masks: dict[int, torch.Tensor]) -> Optional[torch.Tensor]:
        """The low-rank term of `group` in `layer` for input h [T, in] (None when no adapter adapts it)."""
        lr = self.layers[layer].get(group)
        if lr is None:
            return None
        return (h @ lr.a_t).mul_(masks[lr.reps]) @ lr.b_t


def _has(layer, path: str) -> bool:
    try:
        layer.get_submodule(path)
        return True
    except AttributeError:
        return False
