"""Launch plans for the astrai kernels: grid, block, shared memory and typed arguments.

A plan is plain data (`Launch`); an executor runs it. On a GPU the executor is CuPy
(astrai/kernels/cupy_exec.py); the CPU tests run the very same plans through the emulation harness
(tests/kernels/emu), so grid sizing, split planning and argument types are tested without a GPU.

Every scalar argument carries its C type (I32 / I64 / F32): a bare Python int is refused because
CuPy would pass it as a 64-bit integer to a kernel that reads a 32-bit one. Inputs are checked here
(dtypes, shapes, strides, alignment) so a bad call raises a ValueError naming the tensor instead of
corrupting memory on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from astrai.kernels.catalog import KERNELS

ATTN_THREADS = 128  # kAttnThreads in paged_attention.cuh
ATTN_TILE = 32  # kAttnTile
ELEMENTWISE_THREADS = 128
MAX_ATTN_SMEM = 96 * 1024  # per block; above 48 KiB the executor opts in (sm_80+ allow 163 KiB)
PREFILL_TARGET_ROWS = 64  # query rows (tokens x heads of one KV group) per prefill block
MIN_SPLIT_LEN = 256  # fewer K/V positions per split cost more in the merge than they gain
ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class I32(int):
    """A C `int` kernel argument."""


class I64(int):
    """A C `long long` kernel argument."""


class F32(float):
    """A C `float` kernel argument."""


@dataclass(frozen=True)
class Launch:
    kernel: str  # key in catalog.KERNELS
    name_expression: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: tuple


class Executor(Protocol):
    num_sms: int

    def run(self, launch: Launch) -> None: ...

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor: ...


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _expr(kernel: str, dtype: torch.dtype, *extra: str) -> str:
    return KERNELS[kernel].name_expression(_dtype_name(dtype), *extra)


def attn_smem_bytes(row_cap: int, head_dim: int) -> int:
    """Bytes of the layout carve_attn_smem (paged_attention.cuh) makes for row_cap rows."""
    floats = 2 * row_cap * head_dim + ATTN_TILE * (2 * head_dim + 4) + row_cap * ATTN_TILE + 4 * row_cap
    return 4 * floats


def attention_shape_problem(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why the attention kernels cannot serve this model's heads, or None. A decode block holds the
    `group` query rows of one KV head and a prefill block at least as many (one token's), so both
    need attn_smem_bytes(group, head_dim) <= MAX_ATTN_SMEM: checked when the engine picks its
    backend, before any request, rather than by a launch mid-generation."""
    if head_dim % 8 or not 0 < head_dim <= 256:
        return f"the cuda kernels serve head_dim multiples of 8 up to 256, not {head_dim}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}"
    group = num_heads // num_kv_heads
    smem = attn_smem_bytes(group, head_dim)
    if smem > MAX_ATTN_SMEM:
        return (f"{group} query heads per KV head at head_dim {head_dim} need {smem} B of shared memory per "
                f"attention block, above the kernels' {MAX_ATTN_SMEM}")
    return None


def _check_smem(group: int, rows: int, head_dim: int) -> int:
    smem = attn_smem_bytes(rows, head_dim)
    _check(smem <= MAX_ATTN_SMEM, f"{group} query heads per KV head at head_dim {head_dim} need {smem} B of shared "
                                  f"memory per block ({rows} rows), above {MAX_ATTN_SMEM}")
    return smem


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_heads(name: str, x: torch.Tensor, heads: int | None = None) -> None:
    _check(x.dim() == 3, f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    _check(x.stride(2) == 1, f"{name} must have a contiguous last dim, got strides {x.stride()}")
    if heads is not None:
        _check(x.shape[1] == heads, f"{name} has {x.shape[1]} heads, expected {heads}")


def _check_index(name: str, x: torch.Tensor, dtype: torch.dtype, device) -> None:
    _check(x.dtype == dtype and x.is_contiguous(), f"{name} must be a contiguous {dtype} tensor, got {x.dtype}")
    _check(x.device == device, f"{name} is on {x.device}, expected {device}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(c.dim() == 3 and c.is_contiguous(), f"{name} must be a contiguous [num_slots, Hkv, D] tensor")
        _check(c.dtype == dtype, f"{name} is {c.dtype}, queries are {dtype}")
        _check(c.data_ptr() % 16 == 0, f"{name} must be 16-byte aligned")
    _check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    head_dim = k_cache.shape[2]
    _check(head_dim % 8 == 0 and head_dim <= 256, f"head_dim {head_dim} must be a multiple of 8 and <= 256")


def rotary_launch(q, k, positions, cos, sin, interleaved: bool) -> Launch:
    """In-place RoPE on q [T, Hq, D] and k [T, Hkv, D] (views allowed).

    cos/sin: fp32 [max_pos, rot_dim / 2] with a contiguous last dim (a column slice of a wider
    table is fine). A position outside [0, max_pos) yields NaN for that token (no out-of-bounds read).
    """
    _check_heads("q", q)
    _check_heads("k", k)
    _check(q.dtype == k.dtype and q.dtype in ATTN_DTYPES, f"q/k dtypes {q.dtype}/{k.dtype} not supported")
    _check(q.shape[0] == k.shape[0] == positions.shape[0], "q, k and positions disagree on the token count")
    _check_index("positions", positions, torch.int64, q.device)
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table.dtype == torch.float32 and table.dim() == 2 and table.stride(1) == 1,
               f"{name} must be a float32 [max_pos, rot_dim / 2] table with a contiguous last dim")
    _check(cos.shape == sin.shape and cos.stride() == sin.stride(), "cos and sin tables differ in shape or strides")
    rot_dim = 2 * cos.shape[1]
    _check(rot_dim <= q.shape[2] and rot_dim <= k.shape[2], f"rotary dims {rot_dim} exceed head_dim")
    variant = "true" if interleaved else "false"
    args = (q, k, positions, cos, sin, I64(cos.stride(0)), I64(cos.shape[0]), I32(q.shape[1]), I32(k.shape[1]), I32(rot_dim),
            I64(q.stride(0)), I64(q.stride(1)), I64(k.stride(0)), I64(k.stride(1)))
    return Launch("rotary", _expr("rotary", q.dtype, variant), (max(q.shape[0], 1), 1, 1),
                  (ELEMENTWISE_THREADS, 1, 1), 0, args)


def kv_write_launch(k, v, k_cache, v_cache, slots) -> Launch:
    """Scatter k, v [T, Hkv, D] into cache rows `slots` (int64 [T]; negative = skip)."""
    _check_cache(k_cache, v_cache, k.dtype)
    hkv = k_cache.shape[1]
    _check_heads("k", k, hkv)
    _check_heads("v", v, hkv)
    _check(v.dtype == k.dtype, f"k is {k.dtype}, v is {v.dtype}")
    _check(k.shape[0] == v.shape[0] == slots.shape[0], "k, v and slots disagree on the token count")
    _check_index("slots", slots, torch.int64, k.device)
    args = (k, v, k_cache, v_cache, slots, I32(hkv), I32(k_cache.shape[2]),
            I64(k.stride(0)), I64(k.stride(1)), I64(v.stride(0)), I64(v.stride(1)))
    return Launch("kv_write", _expr("kv_write", k.dtype), (max(k.shape[0], 1), 1, 1),
                  (ELEMENTWISE_THREADS, 1, 1), 0, args)


def plan_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, split_len): split long contexts until ~2 blocks per SM, never below MIN_SPLIT_LEN."""
    if max_kv_len <= 0:
        return 1, ATTN_TILE
    blocks = max(batch * num_kv_heads, 1)
    wanted = math.ceil(2 * num_sms / blocks)
    splits = max(1, min(wanted, math.ceil(max_kv_len / MIN_SPLIT_LEN)))
    split_len = math.ceil(math.ceil(max_kv_len / splits) / ATTN_TILE) * ATTN_TILE
    return math.ceil(max_kv_len / split_len), split_len


def _check_paged(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, batch: int) -> None:
    _check(q.dtype in ATTN_DTYPES, f"attention dtype {q.dtype} not supported")
    _check_cache(k_cache, v_cache, q.dtype)
    _check_heads("q", q)
    hq, hkv = q.shape[1], k_cache.shape[1]
    _check(q.shape[2] == k_cache.shape[2], f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[2]}")
    _check(hq % hkv == 0, f"query heads {hq} are not a multiple of KV heads {hkv}")
    for name, t in (("kv_indptr", kv_indptr), ("kv_page_indices", page_indices), ("kv_lens", kv_lens)):
        _check_index(name, t, torch.int32, q.device)
    _check(kv_indptr.shape[0] == batch + 1 and kv_lens.shape[0] == batch,
           f"kv_indptr has {kv_indptr.shape[0]} entries and kv_lens {kv_lens.shape[0]} for {batch} requests")


NO_WINDOW = 1 << 30  # the window the attention kernels get for a layer without a sliding window


def _window(window: int | None) -> I32:
    _check(window is None or 1 <= window < NO_WINDOW, f"sliding window {window} must be in 1..{NO_WINDOW - 1}")
    return I32(NO_WINDOW if window is None else window)


def _scale_log2(scale: float | None, head_dim: int) -> F32:
    """The softmax scale (1/sqrt(head_dim) when None) times log2(e): the kernels exponentiate in base 2."""
    return F32(1.4426950408889634 / math.sqrt(head_dim) if scale is None else 1.4426950408889634 * scale)


def decode_launches(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, page_size: int, max_kv_len: int,
                    out, executor: Executor, num_splits: int | None = None, scale: float | None = None,
                    window: int | None = None) -> list[Launch]:
    """q [B, Hq, D] -> out [B, Hq, D] (contiguous); a merge launch follows when the K/V is split.
    With a sliding window each request's splits cover only its last `window` positions."""
    batch, hq, head_dim = q.shape
    _check_paged(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, batch)
    hkv = k_cache.shape[1]
    if window is not None:
        max_kv_len = min(max_kv_len, window)
    if num_splits is None:
        splits, split_len = plan_splits(batch, hkv, max_kv_len, executor.num_sms)
    else:
        split_len = max(ATTN_TILE, math.ceil(math.ceil(max(max_kv_len, 1) / num_splits) / ATTN_TILE) * ATTN_TILE)
        splits = max(1, math.ceil(max_kv_len / split_len))
    group = hq // hkv
    smem = _check_smem(group, group, head_dim)
    if splits > 1:
        part = executor.empty((batch, hq, splits, head_dim), torch.float32, q.device)
        lse = executor.empty((batch, hq, splits), torch.float32, q.device)
    else:  # never read: the kernel writes `out` directly
        part = lse = executor.empty((1,), torch.float32, q.device)
    scale_log2 = _scale_log2(scale, head_dim)
    args = (q, I64(q.stride(0)), I64(q.stride(1)), k_cache, v_cache, kv_indptr, page_indices, kv_lens, out,
            part, lse, I32(hq), I32(hkv), I32(head_dim), I32(page_size), I32(split_len), _window(window), scale_log2)
    launches = [Launch("paged_decode", _expr("paged_decode", q.dtype), (splits, hkv, max(batch, 1)),
                       (ATTN_THREADS, 1, 1), smem, args)]
    if splits > 1:
        launches.append(Launch("merge_splits", _expr("merge_splits", q.dtype), (batch * hq, 1, 1),
                               (ATTN_THREADS, 1, 1), 0, (part, lse, out, I32(splits), I32(head_dim))))
    return launches


def prefill_tile_tokens(group: int, head_dim: int) -> int:
    """New tokens per prefill block: about PREFILL_TARGET_ROWS rows, within MAX_ATTN_SMEM."""
    tokens = max(1, PREFILL_TARGET_ROWS // group)
    while tokens > 1 and attn_smem_bytes(tokens * group, head_dim) > MAX_ATTN_SMEM:
        tokens -= 1
    return tokens


def prefill_launch(q, k_cache, v_cache, qo_indptr, kv_indptr, page_indices, kv_lens, page_size: int,
                   max_q_len: int, out, tile_tokens: int | None = None, scale: float | None = None,
                   window: int | None = None) -> Launch:
    """q [T, Hq, D] ragged by qo_indptr -> out [T, Hq, D] (contiguous)."""
    batch = kv_lens.shape[0]
    _check_paged(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, batch)
    _check_index("qo_indptr", qo_indptr, torch.int32, q.device)
    _check(qo_indptr.shape[0] == batch + 1, "qo_indptr must have batch + 1 entries")
    hq, head_dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    group = hq // hkv
    tile = tile_tokens or prefill_tile_tokens(group, head_dim)
    smem = _check_smem(group, tile * group, head_dim)
    q_tiles = max(1, math.ceil(max_q_len / tile))
    args = (q, I64(q.stride(0)), I64(q.stride(1)), k_cache, v_cache, qo_indptr, kv_indptr, page_indices, kv_lens,
            out, I32(hq), I32(hkv), I32(head_dim), I32(page_size), I32(tile), _window(window),
            _scale_log2(scale, head_dim))
    return Launch("paged_prefill", _expr("paged_prefill", q.dtype), (q_tiles, hkv, max(batch, 1)),
                  (ATTN_THREADS, 1, 1), smem, args)


# ---- the operations the attention backend calls ----

def rotary(q, k, positions, cos, sin, interleaved: bool, executor: Executor) -> None:
    if q.shape[0]:
        executor.run(rotary_launch(q, k, positions, cos, sin, interleaved))


def write_kv(k, v, k_cache, v_cache, slots, executor: Executor) -> None:
    if k.shape[0]:
        executor.run(kv_write_launch(k, v, k_cache, v_cache, slots))


def decode(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, page_size: int, max_kv_len: int,
           executor: Executor, num_splits: int | None = None, scale: float | None = None,
           window: int | None = None) -> torch.Tensor:
    out = executor.empty(q.shape, q.dtype, q.device)
    if q.shape[0]:
        for launch in decode_launches(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, page_size,
                                      max_kv_len, out, executor, num_splits, scale, window):
            executor.run(launch)
    return out


def prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, page_indices, kv_lens, page_size: int, max_q_len: int,
            executor: Executor, tile_tokens: int | None = None, scale: float | None = None,
            window: int | None = None) -> torch.Tensor:
    out = executor.empty(q.shape, q.dtype, q.device)
    if q.shape[0]:
        executor.run(prefill_launch(q, k_cache, v_cache, qo_indptr, kv_indptr, page_indices, kv_lens, page_size,
                                    max_q_len, out, tile_tokens, scale, window))
    return out
