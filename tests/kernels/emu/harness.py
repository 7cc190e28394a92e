"""Runs astrai's .cu kernels on the CPU: g++ builds them against emu.h, ctypes launches them.

`EmuExecutor` is an executor for astrai.kernels.launch: it runs the same `Launch` plans the CuPy
executor runs on a GPU. For each launch it copies every tensor argument (grouped by storage, so
views into one fused qkv buffer stay one buffer) into a guarded allocation that ends at a
PROT_NONE page, runs the kernel, and copies the bytes back. Outputs it allocates are NaN-filled.
Scalars must be typed (I32/I64/F32) and are checked against the kernel's C signature in C++.

Builds are cached under $TMPDIR/astrai-emu/<hash of sources, emulator, flags>, so only the first
run after a change pays for g++.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import subprocess
import tempfile
from pathlib import Path

import torch

from astrai.kernels.catalog import KERNEL_DIR, KERNELS
from astrai.kernels.launch import F32, I32, I64, Launch

EMU_DIR = Path(__file__).resolve().parent
CXXFLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-w"]
ARG_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int32: 4, torch.int64: 5}
SCALAR_CODES = {I32: 10, I64: 11, F32: 12}


class EmuError(RuntimeError):
    """A kernel fault the emulator caught: bad argument type, deadlock, divergent barrier, out of bounds."""


class LaunchArgs(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem_bytes", ctypes.c_longlong),
                ("nargs", ctypes.c_int), ("codes", ctypes.POINTER(ctypes.c_int)),
                ("values", ctypes.POINTER(ctypes.c_uint64)), ("error", ctypes.c_char_p),
                ("error_len", ctypes.c_longlong)]


def _symbol(i: int) -> str:
    return f"emu_kernel_{i}"


def build(source: str, name_exprs: list[str], kernel_dir: Path = KERNEL_DIR, extra_flags=()) -> ctypes.CDLL:
    """The shared library with one `emu_kernel_<i>` entry per name expression (cached by content)."""
    wrapper = ['#include "emu.h"', f'#include "{kernel_dir / source}"']
    for i, expr in enumerate(name_exprs):
        wrapper.append(f'extern "C" int {_symbol(i)}(const emu::LaunchArgs* a) {{ return emu::launch(&{expr}, a); }}')
    text = "\n".join(wrapper) + "\n"
    digest = hashlib.sha256(text.encode())
    for path in sorted(kernel_dir.glob("*.cu*")) + sorted(EMU_DIR.rglob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(CXXFLAGS + list(extra_flags)).encode())
    out_dir = Path(tempfile.gettempdir()) / "astrai-emu" / digest.hexdigest()[:24]
    lib = out_dir / "kernels.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        cpp = out_dir / "wrapper.cpp"
        cpp.write_text(text)
        tmp = out_dir / f"kernels.{os.getpid()}.so"
        cmd = ["g++", *CXXFLAGS, *extra_flags, f"-I{EMU_DIR / 'include'}", f"-I{EMU_DIR}", f"-I{kernel_dir}",
               str(cpp), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise EmuError(f"g++ failed on {source}:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, end byte) of the memory a (possibly strided) view touches."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


class EmuExecutor:
    """Runs launch plans on the CPU emulator; `empty` gives NaN-poisoned outputs."""

    num_sms = 4  # small, so plan_splits splits contexts of a few hundred tokens

    def __init__(self, kernel_dir: Path = KERNEL_DIR, extra_flags=()):
        self.kernel_dir = Path(kernel_dir)
        self.extra_flags = tuple(extra_flags)
        self._libs: dict[str, ctypes.CDLL] = {}

    def _entry(self, launch: Launch):
        source = KERNELS[launch.kernel].source
        exprs = [e for k in KERNELS.values() if k.source == source for e in k.name_expressions()]
        if source not in self._libs:
            self._libs[source] = build(source, exprs, self.kernel_dir, self.extra_flags)
        lib = self._libs[source]
        fn = getattr(lib, _symbol(exprs.index(launch.name_expression)))
        fn.restype = ctypes.c_int
        return lib, fn

    def empty(self, shape, dtype, device) -> torch.Tensor:
        fill = float("nan") if dtype.is_floating_point else -(2**31)
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)

    def run(self, launch: Launch) -> None:
        lib, fn = self._entry(launch)
        invoke(lib, fn, launch)


def invoke(lib: ctypes.CDLL, fn, launch: Launch) -> None:
    """Launch entry `fn` of `lib` with the plan's grid/block/smem/args (see EmuExecutor)."""
    lib.emu_alloc.restype = ctypes.c_void_p
    lib.emu_alloc.argtypes = [ctypes.c_longlong]
    lib.emu_free.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    tensors = [a for a in launch.args if isinstance(a, torch.Tensor)]
    # One guarded copy per storage: views of one buffer must alias in the kernel as on a GPU.
    buffers: dict[int, list] = {}
    for t in tensors:
        if t.device.type != "cpu":
            raise EmuError(f"the emulator runs on CPU tensors, got one on {t.device}")
        key = t.untyped_storage().data_ptr()
        lo, hi = _span(t)
        if key in buffers:
            buffers[key][0] = min(buffers[key][0], lo)
            buffers[key][1] = max(buffers[key][1], hi)
        else:
            buffers[key] = [lo, hi]
    guarded = {}
    try:
        for key, (lo, hi) in buffers.items():
            ptr = lib.emu_alloc(hi - lo)
            ctypes.memmove(ptr, lo, hi - lo)
            guarded[key] = (ptr, lo, hi)
        codes, values = [], []
        for a in launch.args:
            if isinstance(a, torch.Tensor):
                if a.dtype not in ARG_CODES:
                    raise TypeError(f"{launch.name_expression}: tensor dtype {a.dtype} has no C type")
                ptr, lo, _ = guarded[a.untyped_storage().data_ptr()]
                codes.append(ARG_CODES[a.dtype])
                values.append(ptr + a.data_ptr() - lo)
            elif type(a) in SCALAR_CODES:
                codes.append(SCALAR_CODES[type(a)])
                bits = struct.unpack("<I", struct.pack("<f", a))[0] if type(a) is F32 else int(a) & (2**64 - 1)
                values.append(bits)
            else:
                raise TypeError(f"{launch.name_expression}: argument {a!r} ({type(a).__name__}) is not typed; "
                                "wrap scalars in I32/I64/F32 (CuPy passes a bare int as 64-bit)")
        error = ctypes.create_string_buffer(1024)
        args = LaunchArgs((ctypes.c_uint * 3)(*launch.grid), (ctypes.c_uint * 3)(*launch.block),
                          launch.smem, len(codes), (ctypes.c_int * len(codes))(*codes),
                          (ctypes.c_uint64 * len(values))(*values), ctypes.cast(error, ctypes.c_char_p), 1024)
        if fn(ctypes.byref(args)):
            raise EmuError(f"{launch.name_expression}: {error.value.decode()}")
        for ptr, lo, hi in guarded.values():
            ctypes.memmove(lo, ptr, hi - lo)
    finally:
        for ptr, _, _ in guarded.values():
            lib.emu_free(ptr)
