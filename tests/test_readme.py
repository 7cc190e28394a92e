"""The README stays true: its set-up commands are the ones CI runs, and the files it names exist."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def test_ci_runs_the_readme_test_command():
    readme = read("README.md")
    ci_lines = [l for l in read(".ci/run").splitlines() if "pytest" in l and not l.startswith("#")]
    assert len(ci_lines) == 1
    assert ci_lines[0].strip() in readme


def test_readme_main_command_runs_the_bundled_recipe():
    readme = read("README.md")
    assert re.search(r"^python3 -m venv \.venv .*astrai run recipes/sft\.yaml$", readme, re.M)
    for path in ("recipes/sft.yaml", "pipelines/chatml_sft.yaml", "samples/persona.jsonl", "astrai/data/mask.py",
                 "pipelines/dpo_chatml.yaml", "pipelines/grpo_chatml.yaml", "pipelines/pretrain_text.yaml"):
        assert os.path.exists(os.path.join(ROOT, path)), path
        assert path.split("/")[-1] in readme
