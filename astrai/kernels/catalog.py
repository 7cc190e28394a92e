"""Every kernel source, the template instantiations that are compiled from it, and its budget.

One entry per `.cu` file. An instantiation is looked up by its NVRTC name expression, for example
`paged_decode_kernel<__half>`, so the mangled name never appears in Python. `max_registers` is the
per-thread register budget the compile tier (tests/kernels/test_compile.py) enforces for sm_80 and
sm_90: the attention kernels run 128 threads per block and must keep at least 8 blocks per SM
resident (65536 / (128 * 64)), so their budget is 64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# C++ type of each supported torch dtype name, as it appears in a name expression.
CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ARCHS = ("sm_80", "sm_90")
NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")
_LOCAL_INCLUDE = re.compile(r'\s*#include "([\w.]+)"')


@dataclass(frozen=True)
class Kernel:
    source: str  # file name under astrai/kernels
    template: str  # kernel name
    variants: tuple[tuple[str, ...], ...]  # template arguments after the dtype, one tuple per variant
    max_registers: int

    def name_expression(self, dtype: str, *extra: str) -> str:
        return f"{self.template}<{', '.join((CTYPES[dtype],) + extra)}>"

    def name_expressions(self) -> list[str]:
        return [self.name_expression(d, *v) for d in CTYPES for v in self.variants]


KERNELS = {
    "rotary": Kernel("rotary.cu", "rotary_kernel", (("false",), ("true",)), max_registers=40),
    "kv_write": Kernel("kv_write.cu", "kv_write_kernel", ((),), max_registers=40),
    "paged_decode": Kernel("paged_decode.cu", "paged_decode_kernel", ((),), max_registers=64),
    "merge_splits": Kernel("paged_decode.cu", "merge_splits_kernel", ((),), max_registers=40),
    "paged_prefill": Kernel("paged_prefill.cu", "paged_prefill_kernel", ((),), max_registers=64),
}


def source_text(kernel: Kernel) -> str:
    """The kernel's .cu with its local headers ("common.cuh", ...) inlined, each once.

    CuPy keys its on-disk cubin cache on the source text only, so a header edit must change the
    text it is given; the CPU emulation compiles the files themselves (they are what we ship).
    """
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        lines = []
        for line in (KERNEL_DIR / name).read_text().splitlines():
            m = _LOCAL_INCLUDE.match(line)
            if m:
                lines.append(expand(m.group(1)))
            elif line.strip() != "#pragma once":
                lines.append(line)
        return "\n".join(lines) + "\n"

    return expand(kernel.source)


def cuda_include_dir() -> str | None:
    """Where cuda_fp16.h / cuda_bf16.h live: the nvidia-cuda-runtime wheel, else CUDA_PATH."""
    import os

    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in list(getattr(nvidia, "__path__", [])):
        for sub in ("cu13/include", "cuda_runtime/include"):
            if (Path(root) / sub / "cuda_fp16.h").exists():
                return str(Path(root) / sub)
    cuda_path = os.environ.get("CUDA_PATH", "/usr/local/cuda")
    return str(Path(cuda_path) / "include") if (Path(cuda_path) / "include" / "cuda_fp16.h").exists() else None


def compile_options() -> list[str]:
    """NVRTC options every build uses (CuPy adds -arch itself from the device)."""
    opts = list(NVRTC_OPTIONS)
    include = cuda_include_dir()
    if include:
        opts.append(f"-I{include}")
    return opts
