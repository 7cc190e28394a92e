import sys
from pathlib import Path

import pytest

# The emulation harness lives next to these tests (it is a test tool, not package code).
sys.path.insert(0, str(Path(__file__).resolve().parent / "emu"))


@pytest.fixture(scope="session")
def emu():
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("the emulation tier needs g++")
    from harness import EmuExecutor

    return EmuExecutor()
