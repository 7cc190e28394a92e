"""The `cuda` attention backend with the CPU emulator as its executor: the engine on the real kernels, no GPU."""

from __future__ import annotations

import torch

from astrai.infer.backends.cuda import CudaBackend
from harness import EmuExecutor


class EmuBackend(CudaBackend):
    name = "emu"

    def __init__(self, k_cache, v_cache):
        super().__init__(k_cache, v_cache, executor=EmuExecutor())

    @classmethod
    def supports(cls, device, dtype):
        ok = torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float16, torch.bfloat16)
        return ok, "" if ok else "the emulated kernels run on CPU tensors"
