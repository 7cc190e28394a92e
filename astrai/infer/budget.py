"""The device and the memory an engine asks for, checked before anything is allocated.

`resolve_device` turns `--device` into a torch device, refusing one this machine does not have
(cuda without a GPU or without a CUDA build of torch, cuda:3 on a two-GPU machine) with what to
use instead. `check_engine_memory` adds up what the engine allocates at construction from its
options (the KV pool: 2 x layers x slots x KV heads x head_dim x dtype; the request-to-token table;
the page lists) and refuses, with the figures and the option to lower, when that passes what the
device has free: `--kv-cache-tokens 10**11` or `--page-size 10**9` would otherwise ask the
allocator for terabytes (an error deep inside torch, or the OOM killer when memory is overcommitted).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from astrai.errors import InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE_OVERHEAD_BYTES = 64  # Python bookkeeping per page (free list, refcount, in-tree flag)
USABLE_SHARE = 0.9  # of the free memory: the model's activations need some too


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise InputError(f"--device {spec}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)")
            raise InputError(f"--device {spec}: {why}; use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise InputError(f"--device {spec}: MPS is not available here; use --device cpu (or auto)")
    return device


def resolve_dtype(spec: str, device: torch.device, checkpoint_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(the engine's weight and K/V dtype, why in a few words). `auto` takes bfloat16 where bf16 products
    run faster than float32 (astrai.runtime.hardware.bf16_matmul_fast: the CPU's bf16 dot-product
    instructions, a GPU's bf16 tensor cores; products accumulate in float32 either way), else float32,
    or float16 for a float16 checkpoint on a GPU without bf16."""
    from astrai.runtime.hardware import bf16_matmul_fast

    if spec != "auto":
        return DTYPES[spec], f"dtype {spec} as asked"
    fast, why = bf16_matmul_fast(device)
    if fast:
        return torch.bfloat16, f"dtype auto: bfloat16 ({why})"
    if device.type == "cuda" and checkpoint_dtype == torch.float16:
        return torch.float16, f"dtype auto: float16, the checkpoint's ({why})"
    return torch.float32, f"dtype auto: float32 ({why})"


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory free for new allocations on `device` (None: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    limits = []
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    limits += _cgroup_room()
    if not limits and hasattr(os, "sysconf"):
        try:
            limits.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            pass
    return min(limits) if limits else None


def _cgroup_room() -> list[int]:
    """What the process's memory cgroup (v2) still allows, if it sets a limit."""
    try:
        limit = open("/sys/fs/cgroup/memory.max", encoding="ascii").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read().strip())
    except (OSError, ValueError):
        return []
    return [] if limit == "max" else [max(int(limit) - used, 0)]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PB"


def check_engine_memory(options, config, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse engine options whose KV pool and tables do not fit `device` (InputError with figures)."""
    page_size, kv_tokens = options.page_size, options.kv_cache_tokens
    num_pages = -(-kv_tokens // page_size)
    slots = num_pages * page_size
    elem = torch.empty((), dtype=dtype).element_size()
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem
    table = options.max_running * min(slots, config.max_position_embeddings) * 8
    need = slots * per_slot + table + num_pages * PAGE_OVERHEAD_BYTES
    free = available_bytes(device)
    if free is None or need <= USABLE_SHARE * free:
        return
    rounded = f" (rounded up to whole pages of --page-size {page_size}: {slots:,} slots)" if slots > kv_tokens else ""
    fit = max(int(USABLE_SHARE * free - table) // per_slot, 0)
    raise InputError(
        f"--kv-cache-tokens {kv_tokens:,}{rounded} needs {_size(need)} for the KV cache ({_size(per_slot)} per token "
        f"slot: {config.num_hidden_layers} layers x {config.num_key_value_heads} KV heads x {config.head_dim} x "
        f"{str(dtype).replace('torch.', '')} x K and V) and tables (--max-running {options.max_running}), but "
        f"{device.type} has {_size(free)} free; lower --kv-cache-tokens (about {fit:,} slots fit)"
        + (" and --page-size" if slots > kv_tokens else ""))
