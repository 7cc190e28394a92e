"""The CuPy executor's argument marshalling, which must not depend on a GPU to be right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cupy")

from astrai.kernels.cupy_exec import CupyExecutor  # noqa: E402
from astrai.kernels.launch import F32, I32, I64  # noqa: E402


def _executor_without_device():
    ex = CupyExecutor.__new__(CupyExecutor)  # skip __init__: it asks torch for the device
    ex.device = torch.device("cuda", 0)
    return ex


def test_scalars_keep_their_declared_c_type():
    ex = _executor_without_device()
    assert ex._arg(I32(-3)).dtype == np.int32 and ex._arg(I32(-3)) == -3
    assert ex._arg(I64(2**40)).dtype == np.int64
    assert ex._arg(F32(0.5)).dtype == np.float32
    with pytest.raises(TypeError, match="not typed"):
        ex._arg(7)  # CuPy would pass a bare int as 64-bit to a kernel reading 32
    with pytest.raises(TypeError, match="not typed"):
        ex._arg(0.5)


def test_a_tensor_on_another_device_is_refused():
    ex = _executor_without_device()
    with pytest.raises(ValueError, match="launch on cuda:0"):
        ex._arg(torch.zeros(2))
