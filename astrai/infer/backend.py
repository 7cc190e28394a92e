"""The attention backend contract (shared with the CUDA backend) and how one is chosen.

Storage: per layer `k_cache`, `v_cache` of shape [num_slots, Hkv, D]; slot = page * page_size + offset.
A step runs, per layer: q, k = backend.rotary(q, k, positions, rope) (RoPE before the K/V write, with
the positions the K/V is stored under), backend.write_kv(layer, k, v, slots), then prefill or decode.

`AttentionMeta` is built once per step and shared by every layer:
  qo_indptr [B+1] int32     request b's new tokens are q[qo_indptr[b]:qo_indptr[b+1]]
  kv_indptr [B+1] int32     its pages are kv_page_indices[kv_indptr[b]:kv_indptr[b+1]], in order
  kv_page_indices    int32
  kv_lens   [B]   int32     tokens of K/V of request b, the new ones included (already written)
  page_size
Query i (0-based among request b's q_len new tokens) sits at position kv_len - q_len + i and
attends to K/V positions <= that (and, in a layer with a sliding window W, > that - W); softmax
scale `scale`, 1/sqrt(D) when None (both per layer, from the model: astrai.model.attention).
Grouped-query heads: query head h reads K/V head h // (Hq / Hkv). `decode` is the q_len == 1
case with q of shape [B, Hq, D].
`host` carries the same numbers as Python lists for backends that loop on the host, and `scratch`
is where a backend keeps what it derives from the meta (once per step, not once per layer).

Selection: `select_backend(device, dtype, config)` returns the first of BACKENDS (in priority order)
that can serve the device, the dtype and the model (`supports`, then `serves(config)`: a backend
whose kernels cannot compute a model's attention, e.g. its head_dim or its GQA group x head_dim
within the kernels' shared memory, refuses it so another is chosen before any request, never a
silently wrong result or a failure mid-generation), unless one is forced: `with attn_backend("torch"): ...` (a contextvar, so per thread /
task) or else the ASTRAI_ATTN_BACKEND environment variable. A forced backend that cannot serve
raises BackendUnavailable with its reason; it never falls back silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

ENV_VAR = "ASTRAI_ATTN_BACKEND"
# name -> "module:Class", highest priority first; the CUDA backend registers itself here.
BACKENDS: dict[str, str] = {
    "cuda": "astrai.infer.backends.cuda:CudaBackend",
    "torch": "astrai.infer.backends.torch_native:TorchBackend",
}
_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("astrai_attn_backend", default=None)


class BackendUnavailable(RuntimeError):
    pass


@dataclass
class AttentionMeta:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_lens: torch.Tensor
    page_size: int
    host: dict = field(default_factory=dict)  # qo_indptr, kv_lens, kv_indptr as lists; pages per request
    scratch: dict = field(default_factory=dict)

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], pages: list[list[int]], page_size: int,
              device="cpu") -> "AttentionMeta":
        qo, kv = [0], [0]
        for n, p in zip(q_lens, pages):
            qo.append(qo[-1] + n)
            kv.append(kv[-1] + len(p))
        flat = [x for p in pages for x in p]

        def i32(xs):
            return torch.tensor(xs, dtype=torch.int32, device=device)

        return cls(i32(qo), i32(kv), i32(flat), i32(kv_lens), page_size,
                   host={"qo_indptr": qo, "kv_lens": list(kv_lens), "kv_indptr": kv, "pages": pages})

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)


class AttentionBackend(ABC):
    name = "abstract"

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]):
        self.k_cache = k_cache
        self.v_cache = v_cache

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        """(True, "") or (False, why not) for this device and dtype."""
        return True, ""

    @classmethod
    def serves(cls, config) -> tuple[bool, str]:
        """(True, "") or (False, why not) for this model (an astrai.model.ModelConfig)."""
        return True, ""

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope):
        """RoPE on q [T, Hq, D] and k [T, Hkv, D]; `rope` is the model's Rotary (its float32 cos/sin tables)."""
        from astrai.model.rope import apply_rotary

        cos, sin = rope.cos_sin(positions)
        return apply_rotary(q, k, cos, sin)

    def native_plan(self, meta: AttentionMeta, window: Optional[int] = None):
        """(read slots, counts) of a decode step for astrai's CPU layers operator (the torch backend's), or None."""
        return None

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.k_cache[layer].index_copy_(0, slots, k)
        self.v_cache[layer].index_copy_(0, slots, v)

    @abstractmethod
    def prefill(self, layer: int, q: torch.Tensor, meta: AttentionMeta, window: Optional[int] = None,
                scale: Optional[float] = None) -> torch.Tensor:
        """q [T, Hq, D] ragged over the batch -> o [T, Hq, D]."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, meta: AttentionMeta, window: Optional[int] = None,
               scale: Optional[float] = None) -> torch.Tensor:
        """q [B, Hq, D], one new token per request -> o [B, Hq, D]."""


@contextlib.contextmanager
def attn_backend(name: str):
    """Force a backend inside this block (this thread / task only)."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _load(name: str) -> type[AttentionBackend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def _usable(cls, device, dtype, config) -> tuple[bool, str]:
    ok, why = cls.supports(device, dtype)
    if ok and config is not None:
        ok, why = cls.serves(config)
    return ok, why


def select_backend(device, dtype: torch.dtype, config=None) -> type[AttentionBackend]:
    """The backend class for this device, dtype and model config (None: any model)."""
    device = torch.device(device)
    forced, origin = _forced.get(), "attn_backend()"
    if forced is None and os.environ.get(ENV_VAR):
        forced, origin = os.environ[ENV_VAR], ENV_VAR
    if forced is not None:
        if forced not in BACKENDS:
            raise BackendUnavailable(f"{origin} asks for attention backend {forced!r}; known: {', '.join(BACKENDS)}")
        try:
            cls = _load(forced)
        except ImportError as e:
            raise BackendUnavailable(f"{origin} forces attention backend {forced!r}, which cannot load: {e}") from e
        ok, why = _usable(cls, device, dtype, config)
        if not ok:
            raise BackendUnavailable(f"{origin} forces attention backend {forced!r}, which cannot serve "
                                     f"{device} / {dtype}: {why}")
        return cls
    for name in BACKENDS:
        try:
            cls = _load(name)
        except ImportError:
            continue  # an optional backend whose dependency is absent
        if _usable(cls, device, dtype, config)[0]:
            return cls
    raise BackendUnavailable(f"no attention backend serves {device} / {dtype}")
