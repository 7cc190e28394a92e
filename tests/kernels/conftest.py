import sys
from pathlib import Path

import pytest

# The emulation harness and the references live next to these tests (test tools, not package code).
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "emu"), str(HERE)]


@pytest.fixture(scope="session")
def emu():
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("the emulation tier needs g++")
    from harness import EmuExecutor

    return EmuExecutor()


class Target:
    """Where a kernel test runs: the CPU emulator, or a GPU through CuPy. Inputs are built on the CPU
    and moved with `to`; outputs the executor allocates are NaN-filled on both."""

    def __init__(self, executor, device):
        self.executor, self.device = executor, device

    def to(self, *tensors):
        moved = [t.to(self.device) for t in tensors]
        return moved[0] if len(moved) == 1 else moved


@pytest.fixture(scope="session")
def gpu_executor():
    import torch

    from astrai.kernels.cupy_exec import CupyExecutor

    class PoisonedCupyExecutor(CupyExecutor):
        def empty(self, shape, dtype, device):
            fill = float("nan") if dtype.is_floating_point else -(2**31)
            return torch.full(tuple(shape), fill, dtype=dtype, device=device)

    return PoisonedCupyExecutor(torch.device("cuda"))


@pytest.fixture(params=["emu", pytest.param("gpu", marks=pytest.mark.gpu)])
def target(request):
    import torch

    if request.param == "emu":
        return Target(request.getfixturevalue("emu"), torch.device("cpu"))
    return Target(request.getfixturevalue("gpu_executor"), torch.device("cuda"))
