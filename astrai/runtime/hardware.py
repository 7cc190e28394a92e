"""What the machine multiplies fast: the one home of the bf16 capability probe.

`bf16_matmul_fast(device) -> (bool, reason)` decides whether bfloat16 matrix products beat float32
on `device`; the trainer's `precision: auto` and the engine's `dtype: auto` both ask it, and print
the reason with their choice.

- CPU: only where the cores have bf16 dot-product instructions, AVX-512 BF16 (`avx512_bf16`,
  VDPBF16PS) or AMX (`amx_bf16`, the tile unit), as Linux lists them in /proc/cpuinfo's flags.
  Without them torch still runs bf16 products (it widens each operand to fp32 and rounds the
  result), slower than plain fp32, so every other CPU, and one whose flags cannot be read (no
  /proc/cpuinfo: macOS, Windows), answers False. Arm's bf16 extension is not probed: whether
  torch's Arm kernels beat fp32 with it depends on the core, so fp32 is kept there.
- CUDA: compute capability 8.0 or newer (Ampere on), the first with bf16 tensor-core products;
  older cards emulate bf16 and answer False.
- Anything else (mps, xpu, meta): False, with the device named.

`cpu_flags()` and `cpu_flags_line()` are what benchmarks print so a figure says which kernels the
machine had. torch is imported only for a CUDA device: astrai.data imports this package without it.

NOTE: like the rest of astrai.runtime, this imports nothing from astrai.
"""

from __future__ import annotations

from typing import Optional

CPUINFO = "/proc/cpuinfo"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # either one makes bf16 products faster than fp32
SHOWN_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags(cpuinfo: str = CPUINFO) -> Optional[frozenset]:
    """The instruction-set flags of the first CPU listed in `cpuinfo`, or None where it cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def cpu_flags_line(flags: Optional[frozenset] = None) -> str:
    """'cpu flags: avx2 yes, avx512f no, ...' for the flags that decide the fast kernels."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return f"cpu flags: unknown ({CPUINFO} not readable)"
    return "cpu flags: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in SHOWN_CPU_FLAGS)


def bf16_matmul_fast(device="cpu", flags: Optional[frozenset] = None) -> tuple[bool, str]:
    """(whether bf16 matrix products run faster than fp32 on `device`, why, in a few words).
    `device`: a torch.device or its string; `flags`: the CPU's flags (default: read from /proc/cpuinfo)."""
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    if kind == "cpu":
        flags = cpu_flags() if flags is None else flags
        if flags is None:
            return False, f"cpu flags unknown ({CPUINFO} not readable): bf16 dot products not assumed"
        found = [f for f in BF16_CPU_FLAGS if f in flags]
        if found:
            return True, f"cpu has {' and '.join(found)}"
        return False, "cpu has neither avx512_bf16 nor amx_bf16: bf16 products run slower than fp32 here"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, "no cuda device"
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:
            return True, f"{name} (compute capability {major}.{minor}) has bf16 tensor cores"
        return False, f"{name} (compute capability {major}.{minor}) has no bf16 tensor cores"
    return False, f"device {kind}: bf16 speed not known, fp32 kept"
