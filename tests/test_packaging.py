"""A non-editable install carries everything the code loads at run time (package data).

The wheel built from the checkout is installed into a private folder put first on PYTHONPATH (its
dependencies come from the current venv), and `python -m astrai.cli preprocess` runs from a
directory outside the checkout with the bundled `chat_template: chatml`: it works only if the
templates travel inside the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pip(*args, cwd=None):
    r = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_wheel_runs_a_bundled_template_outside_the_checkout(tmp_path, tiny_tokenizer):
    # Built from a clean copy: a stale astrai.egg-info in the checkout lists the templates from an
    # earlier build, which would hide a missing package-data declaration.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             "runs", ".pytest_cache"))
    _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(src))
    (wheel,) = (tmp_path / "wheel").glob("astrai-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"astrai/templates/chatml.jinja", "astrai/templates/llama3.jinja"} <= set(names)
    site = tmp_path / "site"
    _pip("install", "-q", "--no-deps", "--target", str(site), str(wheel))

    work = tmp_path / "elsewhere"  # outside the checkout: nothing can be read relative to it
    work.mkdir()
    (work / "p.yaml").write_text(
        "version: 1\nchat_template: chatml\n"
        "input: {sections: [{field: messages, action: $role, template: true}]}\n")
    rec = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]}
    (work / "in.jsonl").write_text(json.dumps(rec) + "\n")
    env = {**os.environ, "PYTHONPATH": str(site)}

    where = subprocess.run([sys.executable, "-c", "import astrai; print(astrai.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve().is_relative_to(site.resolve()), where  # the installed copy, not the checkout
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "preprocess", "p.yaml", "-i", "in.jsonl", "-o", "out",
                        "--tokenizer", str(tiny_tokenizer), "--workers", "1"],
                       cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    assert manifest["chat_template"] == "chatml" and manifest["counts"]["records_kept"] == 1
