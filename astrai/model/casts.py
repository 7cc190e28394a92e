"""Casts of frozen weights for mixed-precision training (bf16-mixed), made once and kept.

torch.autocast caches its casts of weights that require grad (leaf tensors), for one forward; a frozen weight
(a LoRA base projection, a tied embedding used as the LM head) is cast again at every forward, and the copy is
kept for the backward anyway. `frozen_cast(w, dtype)` returns w in `dtype`, cast once and again only when w
changes (its data pointer or version counter moved), held while w lives (a weak reference). The values are the
ones autocast would compute: the same rounding of the same weight.

`shared_input(x)` casts an activation once for the several products that read it (q/k/v, gate/up): autocast
casts it per product, three times for q/k/v, and casts each product's gradient back to float32 separately.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

_CASTS = WeakTensorKeyDictionary()  # weight -> ((data pointer, version, dtype), the cast)


def tensor_version(w: torch.Tensor) -> int:
    """w's version counter (it moves at each in-place change), or -1 for a tensor made under inference_mode."""
    try:
        return w._version
    except RuntimeError:  # made under inference_mode: no version counter, and never changed in place
        return -1


def frozen_cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`, cast once and kept while w is unchanged (see the module docstring)."""
    if w.dtype == dtype:
        return w
    key = (w.data_ptr(), tensor_version(w), dtype)
    held = _CASTS.get(w)
    if held is None or held[0] != key:
        held = (key, w.detach().to(dtype))
        _CASTS[w] = held
    return held[1]


def autocast_dtype(device: str) -> Optional[torch.dtype]:
    """autocast's dtype for `device` (a device type: "cpu", "cuda") while autocast is on there, else None."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def shared_input(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype where autocast is on for x's device and x is float32 (what autocast would give each
    product that reads x, cast once; the products' gradients then sum in that dtype, one rounding more, and are
    cast back once); x itself otherwise."""
    dtype = autocast_dtype(x.device.type) if x.dtype == torch.float32 else None
    return x if dtype is None else x.to(dtype)
