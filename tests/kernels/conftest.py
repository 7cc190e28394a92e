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
