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
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import torch

from astrai.kernels.catalog import KERNEL_DIR, KERNELS
from astrai.kernels.launch import F32, I32, I64, Launch

EMU_DIR = Path(__file__).resolve().parent
CXXFLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-w"]
# Real-thread mode: a standalone executable (the sanitizer runtime must start with the process).
SANITIZER_FLAGS = {
    "thread": ["-O1", "-g", "-std=c++17", "-pthread", "-fno-strict-aliasing", "-w", "-DEMU_THREADS",
               "-fsanitize=thread"],
    "address": ["-O1", "-g", "-std=c++17", "-pthread", "-fno-strict-aliasing", "-w", "-DEMU_THREADS",
                "-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
}
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


def build(source: str, name_exprs: list[str], kernel_dir: Path = KERNEL_DIR, extra_flags=(), sanitizer=None):
    """The shared library with one `emu_kernel_<i>` entry per name expression (cached by content);
    with `sanitizer` ("thread" / "address"), the path of a real-thread-mode executable instead."""
    wrapper = ['#include "emu.h"', f'#include "{kernel_dir / source}"']
    for i, expr in enumerate(name_exprs):
        wrapper.append(f'extern "C" int {_symbol(i)}(const emu::LaunchArgs* a) {{ return emu::launch(&{expr}, a); }}')
    flags = list(CXXFLAGS)
    if sanitizer:
        flags = list(SANITIZER_FLAGS[sanitizer])
        table = ", ".join(_symbol(i) for i in range(len(name_exprs)))
        wrapper += [f"int (*emu_table[])(const emu::LaunchArgs*) = {{{table}}};", '#include "emu_main.cpp"']
    text = "\n".join(wrapper) + "\n"
    digest = hashlib.sha256(text.encode())
    for path in sorted(kernel_dir.glob("*.cu*")) + sorted(EMU_DIR.rglob("*.h")) + [EMU_DIR / "emu_main.cpp"]:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(flags + list(extra_flags)).encode())
    out_dir = Path(tempfile.gettempdir()) / "astrai-emu" / digest.hexdigest()[:24]
    lib = out_dir / ("kernels" if sanitizer else "kernels.so")
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        cpp = out_dir / "wrapper.cpp"
        cpp.write_text(text)
        tmp = out_dir / f"kernels.{os.getpid()}.tmp"
        cmd = ["g++", *flags, *extra_flags, f"-I{EMU_DIR / 'include'}", f"-I{EMU_DIR}", f"-I{kernel_dir}",
               str(cpp), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise EmuError(f"g++ failed on {source}:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib if sanitizer else ctypes.CDLL(str(lib))


def kernel_copy(overrides: dict[str, str], base: Path | None = KERNEL_DIR) -> Path:
    """A copy of the kernel sources (or of nothing, base=None) with some files replaced, in a
    directory named by its content, so builds of planted-bug variants are cached across runs too."""
    files = {f.name: f.read_text() for f in sorted(base.glob("*.cu*"))} if base else {}
    files.update(overrides)
    digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:24]
    out = Path(tempfile.gettempdir()) / "astrai-emu-src" / digest
    if not out.exists():
        tmp = out.with_name(f"{digest}.{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp / name).write_text(text)
        try:
            os.replace(tmp, out)
        except OSError:  # another process made it first: same content
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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


def _storage_spans(launch: Launch) -> dict[int, list[int]]:
    """storage key -> [first byte, end byte) covering every tensor argument that lives in it.

    One buffer per storage: views of one fused qkv tensor must alias in the kernel as on a GPU.
    """
    spans: dict[int, list[int]] = {}
    for t in launch.args:
        if not isinstance(t, torch.Tensor):
            continue
        if t.device.type != "cpu":
            raise EmuError(f"the emulator runs on CPU tensors, got one on {t.device}")
        lo, hi = _span(t)
        span = spans.setdefault(t.untyped_storage().data_ptr(), [lo, hi])
        span[0], span[1] = min(span[0], lo), max(span[1], hi)
    return spans


def _encode(launch: Launch, pointer) -> tuple[list[int], list[int]]:
    """(type codes, 64-bit values) of the arguments; `pointer(tensor)` gives a tensor's value."""
    codes, values = [], []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            if a.dtype not in ARG_CODES:
                raise TypeError(f"{launch.name_expression}: tensor dtype {a.dtype} has no C type")
            codes.append(ARG_CODES[a.dtype])
            values.append(pointer(a))
        elif type(a) in SCALAR_CODES:
            codes.append(SCALAR_CODES[type(a)])
            values.append(struct.unpack("<I", struct.pack("<f", a))[0] if type(a) is F32 else int(a) & (2**64 - 1))
        else:
            raise TypeError(f"{launch.name_expression}: argument {a!r} ({type(a).__name__}) is not typed; "
                            "wrap scalars in I32/I64/F32 (CuPy passes a bare int as 64-bit)")
    return codes, values


def invoke(lib: ctypes.CDLL, fn, launch: Launch) -> None:
    """Launch entry `fn` of `lib` with the plan's grid/block/smem/args (see EmuExecutor)."""
    lib.emu_alloc.restype = ctypes.c_void_p
    lib.emu_alloc.argtypes = [ctypes.c_longlong]
    lib.emu_free.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    guarded = {}
    try:
        for key, (lo, hi) in _storage_spans(launch).items():
            ptr = lib.emu_alloc(hi - lo)
            ctypes.memmove(ptr, lo, hi - lo)
            guarded[key] = (ptr, lo, hi)

        def pointer(t):
            ptr, lo, _ = guarded[t.untyped_storage().data_ptr()]
            return ptr + t.data_ptr() - lo

        codes, values = _encode(launch, pointer)
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


class SanitizerExecutor(EmuExecutor):
    """Real-thread mode under ThreadSanitizer or AddressSanitizer+UBSan: each launch runs in a
    subprocess (the sanitizer runtime must start with the process) on exact-size malloc'd buffers.
    A sanitizer report, a failed launch or a hang (timeout) raises EmuError with the report."""

    def __init__(self, sanitizer: str, kernel_dir: Path = KERNEL_DIR, timeout: float = 120):
        super().__init__(kernel_dir)
        self.sanitizer, self.timeout = sanitizer, timeout
        self._exes: dict[str, Path] = {}

    def run(self, launch: Launch) -> None:
        source = KERNELS[launch.kernel].source
        exprs = [e for k in KERNELS.values() if k.source == source for e in k.name_expressions()]
        if source not in self._exes:
            self._exes[source] = build(source, exprs, self.kernel_dir, sanitizer=self.sanitizer)
        spans = _storage_spans(launch)
        keys = list(spans)

        def pointer(t):
            key = t.untyped_storage().data_ptr()
            return keys.index(key) << 40 | (t.data_ptr() - spans[key][0])

        codes, values = _encode(launch, pointer)
        blob = [struct.pack("<q3I3Iqq", exprs.index(launch.name_expression), *launch.grid, *launch.block,
                            launch.smem, len(keys))]
        for key in keys:
            lo, hi = spans[key]
            blob += [struct.pack("<q", hi - lo), ctypes.string_at(lo, hi - lo)]
        blob.append(struct.pack("<q", len(codes)))
        blob += [struct.pack("<iQ", c, v) for c, v in zip(codes, values)]
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
            src.write_bytes(b"".join(blob))
            env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66",
                       ASAN_OPTIONS="detect_leaks=0 exitcode=66", UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1")
            try:
                done = subprocess.run([str(self._exes[source]), str(src), str(dst)], capture_output=True, text=True,
                                      timeout=self.timeout, env=env)
            except subprocess.TimeoutExpired as e:
                raise EmuError(f"{launch.name_expression}: no progress in {self.timeout} s (deadlock?)") from e
            if done.returncode:
                raise EmuError(f"{launch.name_expression} under {self.sanitizer} sanitizer (exit {done.returncode}):\n"
                               f"{done.stderr[-6000:]}")
            out = dst.read_bytes()
        offset = 0
        for key in keys:
            lo, hi = spans[key]
            ctypes.memmove(lo, out[offset:offset + hi - lo], hi - lo)
            offset += hi - lo
