"""Several LoRA adapters served side by side on one base, requests for different adapters batched in
one step.

An `AdapterBank` holds n adapters (PEFT directories trained on the engine's base, each checked
against it by astrai.model.adapter_files.check_adapter before a tensor is read) in the engine's
dtype, per layer and per packed projection group:

    qkv      q_proj, k_proj, v_proj      o        o_proj
    gate_up  gate_proj, up_proj          down     down_proj

For a group of k projections p, with r the largest rank of the adapters, adapter j holds

    a[j]         [in, k * r]   column block p = A_j(p)^T (zero where adapter j does not adapt p, or
                               past its own rank)
    b[j * L + p] [r, o]        scaling_j * B_j(p)^T, per run of L consecutive projections of one
                               output width o (q alone and k, v together under grouped-query
                               attention; gate and up together)

A step whose tokens belong to requests of different adapters (0 = the base) places its tokens by
adapter once (`AdapterBank.rows`: the adapters present, from the first to the last, each with m
slots, m the most tokens any of them has; a slot past an adapter's tokens is padding), and computes
for a projection group's input h [T, in] and its output y = h @ W (the packed base weights)

    u = gather(h) @ a               one batched matmul, [n, m, in] @ [n, in, k r]
    y + back(u_run @ b_run)         per run, one batched matmul, [n L, m, r] @ [n L, r, o]

where gather puts each token in a slot of its adapter (padding slots multiplied by 0) and back reads
each token's rows out of its slot again (a base token reads a padding slot: exactly 0). So each
token multiplies by its own adapter's weights only, with no Python per adapter: n m r (k in + sum of
out) multiply-adds per group (n m: the T tokens and the padding), against T n r (k in + k sum of out)
when every token meets every adapter's stacked weights under a mask, B block-diagonal. The result
equals the adapter merged into the base (W + s B A, as `load_checkpoint` serves one adapter) up to
the rounding of the two ways of summing. Steps without adapter tokens run the plain forward and pay
nothing.

Adapters may target the attention and dense MLP projections; the LM head, the embeddings and
experts are refused by name (their products are not in these groups).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from astrai.model.adapter_config import AdapterError, read_adapter_config
from astrai.model.adapter_files import check_adapter, read_adapter, read_adapter_header

GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
_SERVED = {p for ps in GROUPS.values() for p in ps}  # module paths inside a decoder layer


@dataclass
class LowRank:
    a: torch.Tensor  # [n, in, k * r]: adapter j's A(p)^T side by side over the group's k projections
    # per run of consecutive projections of one output size o, L of them: ([n * L, r, o], L), row j * L + p
    # = adapter j's scaling * B(p)^T
    runs: list[tuple[torch.Tensor, int]]


@dataclass
class Rows:
    """Where a step's tokens sit among the adapters' slots (`AdapterBank.rows`): the adapters lo..hi-1
    (0-based), m slots each."""
    lo: int
    hi: int
    m: int
    gather: Optional[torch.Tensor]  # [(hi - lo) * m]: the token in each slot (None: the tokens in order)
    pad: Optional[torch.Tensor]  # [hi - lo, m, 1]: 0 on padding slots, 1 elsewhere (None: no padding)
    slot: list[int]  # each token's slot (a base token: a padding one)
    device: torch.device
    _back: dict = field(default_factory=dict)

    def back(self, reps: int) -> Optional[torch.Tensor]:
        """[T * reps]: for token t and projection p < reps, the row (j * reps + p) * m + s of the run's
        product [n * reps * m, o] that holds it (slot j * m + s); None when that is row t itself and the
        product has no rows past the tokens' (unfilled slots of the last adapter)."""
        if reps not in self._back:
            m = self.m
            rows = [(s // m * reps + p) * m + s % m for s in self.slot for p in range(reps)]
            same = rows == list(range(len(rows))) and len(self.slot) == (self.hi - self.lo) * m
            self._back[reps] = None if same else torch.tensor(rows, device=self.device)
        return self._back[reps]


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
                a = torch.zeros(n, mods[0].in_features, len(projs) * r, dtype=torch.float32)
                bs = [torch.zeros(n, r, m.out_features, dtype=torch.float32) for m in mods]
                for pi, key in enumerate(keys):
                    for j, (cfg, t) in enumerate(zip(configs, tensors)):
                        lora_a, lora_b = t.get(f"{key}.lora_A.weight"), t.get(f"{key}.lora_B.weight")
                        if lora_a is not None:
                            a[j, :, pi * r:pi * r + cfg.r] = lora_a.float().t()
                            bs[pi][j, :cfg.r] = cfg.scaling * lora_b.float().t()
                runs, start = [], 0
                for pi in range(1, len(bs) + 1):  # consecutive projections of one output size share a product
                    if pi == len(bs) or bs[pi].shape != bs[start].shape:
                        b = torch.stack(bs[start:pi], 1).flatten(0, 1)  # [n * L, r, o], adapter-major
                        runs.append((b.to(device=device, dtype=dtype), pi - start))
                        start = pi
                groups[group] = LowRank(a.to(device=device, dtype=dtype), runs)
            layers.append(groups)
        return cls(list(adapters), [c.r for c in configs], layers)

    def adapter_id(self, name: Optional[str]) -> int:
        """0 for the base (None), the adapter's index otherwise; KeyError for a name the bank lacks."""
        return 0 if name is None else self.index[name]

    def rows(self, adapter_ids: list[int], q_lens: list[int], dtype: torch.dtype, device: torch.device) -> Rows:
        """The slots of a step's tokens (request i: q_lens[i] tokens of adapter adapter_ids[i]); made once per
        step on the host, read by every layer. At least one adapter id is not 0."""
        per_token = [a for a, q in zip(adapter_ids, q_lens) for _ in range(q)]
        present = sorted({a for a in per_token if a})
        lo, hi = present[0] - 1, present[-1]
        slots: list[list[int]] = [[] for _ in range(hi - lo)]
        for t, a in enumerate(per_token):
            if a:
                slots[a - 1 - lo].append(t)
        m = max(map(len, slots))
        if 0 in per_token and all(len(s) == m for s in slots):
            m += 1  # a padding slot for the base's tokens to read
        gather = [s[k] if k < len(s) else 0 for s in slots for k in range(m)]
        slot, pad_slot = [0] * len(per_token), None
        for j, s in enumerate(slots):
            for k, t in enumerate(s):
                slot[t] = j * m + k
            if len(s) < m and pad_slot is None:
                pad_slot = j * m + len(s)
        for t, a in enumerate(per_token):
            if not a:
                slot[t] = pad_slot
        pad = None
        if any(len(s) < m for s in slots):
            pad = torch.tensor([[1.0] * len(s) + [0.0] * (m - len(s)) for s in slots], dtype=dtype, device=device)
            pad = pad[:, :, None]
        ordered = gather == list(range(len(gather)))
        return Rows(lo, hi, m, None if ordered else torch.tensor(gather, device=device), pad, slot, device)

    def delta(self, layer: int, group: str, h: torch.Tensor, rows: Rows) -> Optional[torch.Tensor]:
        """The low-rank term [T, out] of `group` in `layer` for input h [T, in] (None when no adapter adapts it)."""
        lr = self.layers[layer].get(group)
        if lr is None:
            return None
        n, m, r, t = rows.hi - rows.lo, rows.m, self.r, h.shape[0]
        hg = h if rows.gather is None else h.index_select(0, rows.gather)
        u = torch.bmm(hg.reshape(n, m, h.shape[1]), lr.a[rows.lo:rows.hi])  # [n, m, k r]
        if rows.pad is not None:
            u.mul_(rows.pad)
        out, col = [], 0
        for b, reps in lr.runs:
            part = u[..., col:col + reps * r]
            col += reps * r
            if reps > 1:  # [n, m, L r] -> [n L, m, r]: adapter j's projection p at j L + p, as b's rows
                part = part.reshape(n, m, reps, r).transpose(1, 2).reshape(n * reps, m, r)
            y = torch.bmm(part, b[rows.lo * reps:rows.hi * reps]).view(n * reps * m, -1)
            back = rows.back(reps)
            out.append((y if back is None else y.index_select(0, back)).view(t, -1))
        return out[0] if len(out) == 1 else torch.cat(out, 1)


def _has(layer, path: str) -> bool:
    try:
        layer.get_submodule(path)
        return True
    except AttributeError:
        return False
