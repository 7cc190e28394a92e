"""The CPU engine's own few-row product kernels (astrai/infer/kernels/cpu_gemv.cpp), built at first use.

`kernels()` returns the instruction set the kernels run with on this CPU (a `Kernels`), or None where
they cannot run: not x86 with AVX2 and FMA (the flags in /proc/cpuinfo), no C++ compiler, a build that
failed, or `ASTRAI_NATIVE=0` in the environment. Callers then keep torch's products: the kernels are a
speed-up, never a requirement, and nothing computes a different result without them beyond the order of
float32 additions.

- `gemv_bf16(x, w)`: x [M, K] bf16 @ w [N, K]^T bf16 -> [M, N] bf16 (float32 sums, rounded once);
  AVX-512 BF16's VDPBF16PS where the CPU has it, else bf16 widened to float32 under AVX2 + FMA.
- `gemv_int8(x, w, scales)`: x [M, K] float32 @ (w [N, K] int8 * scales [N])^T -> [M, N] float32, as
  torch's `_weight_int8pack_mm` (AVX-512F or AVX2).

Both are for the few rows of a decode step (up to GEMV_ROWS): each thread of torch's pool streams a
contiguous range of W's rows once for all rows of x. Larger steps (prefill) keep torch's products,
whose blocked kernels (AMX, MKL) reuse each weight over many rows.

The build: torch.utils.cpp_extension compiles the source once per (source, torch version, compiler)
into the user's astrai cache (`kernels/cpu_gemv-<digest>`, a directory astrai makes and owns; about 25 s
on two cores), and later processes load the built library in milliseconds. A failed build is said once
on stderr, with its first error line, and the engine goes on with torch's products.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from astrai.cache import cache_root
from astrai.errors import InputError
from astrai.runtime.hardware import cpu_flags

SOURCE = Path(__file__).resolve().parent / "kernels" / "cpu_gemv.cpp"
GEMV_ROWS = 4  # steps of up to this many rows use the kernels (bench/RESULTS.md: level with torch's from ~8)
ISA_AVX2, ISA_AVX512_BF16 = 1, 2


@dataclass(frozen=True)
class Kernels:
    bf16_isa: int  # ISA_AVX512_BF16 or ISA_AVX2
    int8_isa: int  # ISA_AVX512_BF16 means AVX-512F here
    name: str  # what the machine runs, for logs and benchmarks

    def gemv_bf16(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.astrai.gemv_bf16(x.contiguous(), w, self.bf16_isa)

    def gemv_int8(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.ops.astrai.gemv_int8(x.contiguous(), w, scales, self.int8_isa)


_STATE: dict = {}  # "kernels": the Kernels or None once decided in this process


def isa_for(flags: Optional[frozenset]) -> Optional[Kernels]:
    """The kernels' instruction sets on a CPU with `flags` (None: not x86 with AVX2 + FMA, or unknown)."""
    if not flags or not {"avx2", "fma"} <= flags:
        return None
    avx512 = {"avx512f", "avx512bw"} <= flags
    bf16 = ISA_AVX512_BF16 if avx512 and "avx512_bf16" in flags else ISA_AVX2
    int8 = ISA_AVX512_BF16 if avx512 else ISA_AVX2
    return Kernels(bf16, int8, f"bf16 {'avx512_bf16' if bf16 == ISA_AVX512_BF16 else 'avx2'}, "
                               f"int8 {'avx512f' if int8 == ISA_AVX512_BF16 else 'avx2'}")


def kernels() -> Optional[Kernels]:
    """This CPU's kernels, built or loaded on the first call (see the module docstring), or None."""
    if "kernels" not in _STATE:
        _STATE["kernels"] = _load()
    return _STATE["kernels"]


def _load() -> Optional[Kernels]:
    if os.environ.get("ASTRAI_NATIVE", "1") == "0":
        return None
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    chosen = isa_for(cpu_flags())
    if chosen is None:
        return None
    try:
        _build()
    except Exception as e:  # no compiler, no headers, a full disk: torch's products instead
        lines = str(e).splitlines() or [""]
        first = next((ln for ln in lines if " error: " in ln), lines[0])
        print(f"astrai: the CPU product kernels did not build ({type(e).__name__}: {first.strip()[:200]}); "
              "using torch's", file=sys.stderr)
        return None
    return chosen


def build_dir() -> Path:
    """Where the kernels of this source and torch version are built (inside astrai's cache)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu_gemv-{digest}"


def _build() -> None:
    if hasattr(torch.ops.astrai, "gemv_bf16"):  # already registered in this process
        return
    from torch.utils.cpp_extension import load

    try:
        where = build_dir()
    except InputError as e:
        raise OSError(str(e)) from None
    where.mkdir(parents=True, exist_ok=True)
    if where.is_symlink() or not where.is_dir():
        raise OSError(f"{where} is not a directory astrai made")
    load(name="astrai_cpu_gemv", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"], build_directory=str(where),
         is_python_module=False, verbose=False)
