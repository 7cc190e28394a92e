"""The online GRPO tests' prompt set: a tiny chat checkpoint and its preprocessed prompts, built once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rollout_helpers, for the tests of this folder

from rollout_helpers import QUESTIONS, REWARDS  # noqa: E402


@pytest.fixture(scope="session")
def setup(tmp_path_factory, tiny_tokenizer, make_chat_checkpoint):
    root = tmp_path_factory.mktemp("online")
    ckpt = make_chat_checkpoint(root / "ckpt", tiny_tokenizer)
    with open(root / "prompts.jsonl", "w") as fh:
        for i, q in enumerate(QUESTIONS * 2):
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}], "answer": ["yes", "no"][i % 2]}) + "\n")
    (root / "pipe.yaml").write_text(
        f"version: 1\ntokenizer: {ckpt}\nchat_template: tokenizer\ninput:\n  sections:\n"
        "    - {field: messages, action: mask, template: true, add_generation_prompt: true}\n"
        "    - {field: answer, action: value, value_type: string}\n")
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "preprocess", str(root / "pipe.yaml"), "-i",
                        str(root / "prompts.jsonl"), "-o", str(root / "data"), "--workers", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (root / "my_rewards.py").write_text(REWARDS)
    return root, Path(ckpt)
