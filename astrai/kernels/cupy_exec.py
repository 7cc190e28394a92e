"""Runs launch plans (astrai.kernels.launch) on a GPU through CuPy, on torch tensors in place.

Modules are compiled by NVRTC through `cupy.RawModule(code=..., name_expressions=...)` and cached
per (kernel, dtype, arch) for the life of the process (CuPy also caches the cubin on disk). A
launch passes each tensor as its raw device pointer and each scalar with its declared C type, on
torch's current stream, so kernels order correctly with the surrounding torch work.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from astrai.kernels.catalog import CTYPES, KERNELS, compile_options, source_text
from astrai.kernels.launch import F32, I32, I64, Launch

_SCALARS = {I32: np.int32, I64: np.int64, F32: np.float32}
_DEFAULT_SMEM = 48 * 1024
_modules: dict[tuple[str, str, str], object] = {}
_lock = threading.Lock()


def _cupy():
    try:
        import cupy
    except ImportError as e:  # the caller turns this into "cuda backend unavailable: ..."
        raise ImportError(f"CuPy is not installed (pip install 'astrai[cuda]'): {e}") from e
    return cupy


def module_for(kernel: str, ctype: str, arch: str):
    """The compiled RawModule holding every variant of `kernel` for one dtype and arch."""
    key = (kernel, ctype, arch)
    with _lock:
        if key not in _modules:
            cupy = _cupy()
            spec = KERNELS[kernel]
            exprs = [e for e in spec.name_expressions() if e.startswith(f"{spec.template}<{ctype}")]
            _modules[key] = cupy.RawModule(code=source_text(spec), options=tuple(compile_options()),
                                           name_expressions=exprs)
        return _modules[key]


class CupyExecutor:
    def __init__(self, device: torch.device):
        device = torch.device(device)
        # "cuda" and "cuda:0" must compare equal against the tensors' devices
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        self.num_sms = props.multi_processor_count
        self.arch = f"sm_{props.major}{props.minor}"
        self._functions: dict[str, object] = {}

    def empty(self, shape, dtype, device) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def _function(self, launch: Launch):
        fn = self._functions.get(launch.name_expression)
        if fn is None:
            ctype = next(c for c in CTYPES.values() if f"<{c}" in launch.name_expression)
            with _cupy().cuda.Device(self.device.index):
                fn = module_for(launch.kernel, ctype, self.arch).get_function(launch.name_expression)
            self._functions[launch.name_expression] = fn
        if launch.smem > _DEFAULT_SMEM and fn.max_dynamic_shared_size_bytes < launch.smem:
            fn.max_dynamic_shared_size_bytes = launch.smem  # opt in above 48 KiB (sm_80+)
        return fn

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            if a.device != self.device:
                raise ValueError(f"kernel argument on {a.device}, launch on {self.device}")
            return np.uint64(a.data_ptr())
        if type(a) in _SCALARS:
            return _SCALARS[type(a)](a)
        raise TypeError(f"kernel argument {a!r} ({type(a).__name__}) is not typed: wrap it in I32/I64/F32")

    def run(self, launch: Launch) -> None:
        cupy = _cupy()
        fn = self._function(launch)
        args = tuple(self._arg(a) for a in launch.args)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with cupy.cuda.Device(self.device.index), cupy.cuda.ExternalStream(stream):
            fn(launch.grid, launch.block, args, shared_mem=launch.smem)
