"""The engine's verbs run with torch's transparent-huge-page allocation (astrai.cli.engine_memory), set before
torch is imported; a value the user set is kept, and other verbs are left alone."""

import os
import subprocess
import sys

import pytest

CODE = ("import sys, os; import astrai.cli as c; assert 'torch' not in sys.modules; c.engine_memory(sys.argv[1]); "
        "import torch; x = torch.empty(8 << 20, dtype=torch.uint8); "
        "print(os.environ.get('THP_MEM_ALLOC_ENABLE', '-'))")


def _run(verb: str, env_value=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", CODE, verb], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("verb", ["generate", "serve", "chat", "eval"])
def test_engine_verbs_turn_huge_pages_on(verb):
    assert _run(verb) == "1"


def test_a_users_choice_is_kept_and_other_verbs_are_left_alone():
    assert _run("generate", "0") == "0"
    assert _run("train") == "-"
    assert _run("preprocess") == "-"


def test_once_torch_is_imported_nothing_is_set(monkeypatch):
    import torch  # noqa: F401  (the allocator has read its setting: setting it now would only mislead)

    from astrai.cli import engine_memory

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    engine_memory("generate")
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ
