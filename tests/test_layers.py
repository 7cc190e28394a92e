"""The module graph: small files, and no import that runs back up the layers.

Layers, bottom up: schema, errors, runtime, runtime_ray (import nothing from astrai), cache (runtime, errors) -> config (loading,
pipeline, stages, recipe) -> text (tokenizer, chat template, prompts: shared by data, train and infer)
-> data -> [model, train, infer] -> serve (the HTTP server and terminal chat, on infer) -> recipe
(chaining stages) -> cli. data may read the pipeline model
and the stage options, never the recipe model, the CLI, train or infer; config never imports a
stage's code.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "astrai"
MAX_LINES = 400

FORBIDDEN = {  # module prefix -> modules it must not import
    "astrai.schema": ("astrai.",),
    "astrai.errors": ("astrai.",),
    "astrai.text": ("astrai.data", "astrai.cli", "astrai.config.recipe", "astrai.train", "astrai.infer", "astrai.model",
                    "astrai.recipe"),
    "astrai.runtime": ("astrai.",),
    "astrai.cache": tuple(f"astrai.{m}" for m in ("schema", "config", "text", "data", "model", "train",
                                                  "infer", "serve", "rl", "recipe", "cli")),  # runtime, errors
    "astrai.runtime_ray": ("astrai.",),
    "astrai.config": ("astrai.data", "astrai.cli", "astrai.train", "astrai.infer", "astrai.model", "astrai.recipe"),
    "astrai.data": ("astrai.cli", "astrai.config.recipe", "astrai.train", "astrai.infer", "astrai.recipe"),
    "astrai.recipe": ("astrai.cli",),
    "astrai.infer": ("astrai.serve", "astrai.cli", "astrai.train", "astrai.recipe", "astrai.rl"),
    "astrai.train": ("astrai.infer", "astrai.serve", "astrai.cli", "astrai.recipe", "astrai.rl"),
    # online RL sits above train and infer (it drives both), below the recipe runner and the CLI
    "astrai.rl": ("astrai.serve", "astrai.cli", "astrai.recipe"),
    # the server is a client of the engine: it never reaches into training, data or the CLI
    "astrai.serve": ("astrai.train", "astrai.data", "astrai.cli", "astrai.recipe"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """astrai modules a file imports (at any level), names from astrai.config resolved to their module."""
    from astrai.config import _HOME, _ALIASES

    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("astrai")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("astrai"):
            if node.module == "astrai.config":
                out |= {f"astrai.config.{_HOME[_ALIASES.get(a.name, a.name)]}" for a in node.names}
            else:
                out.add(node.module)
    return out


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small_and_imports_downward(path):
    assert len(path.read_text(encoding="utf-8").splitlines()) <= MAX_LINES
    name = module_name(path)
    for prefix, banned in FORBIDDEN.items():
        if name == prefix or name.startswith(prefix + "."):
            bad = sorted(m for m in imported(path) if m.startswith(banned) and not m.startswith(prefix + "."))
            assert not bad, f"{name} imports {bad}"


def test_the_rules_see_a_violation():
    # the checker itself: the CLI package imports the recipe model, which data may not
    assert "astrai.config.recipe" in imported(PACKAGE / "cli" / "run.py")


def test_importing_the_data_stage_loads_nothing_above_it():
    code = ("import sys, astrai.data.preprocess, astrai.data.inspect, astrai.data.export\n"
            "print(sorted(m for m in sys.modules if m.startswith(('astrai.cli', 'astrai.config.recipe', 'torch'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_checking_a_recipe_does_not_load_torch():
    # `astrai run` on an up-to-date recipe validates it and skips every stage: importing torch
    # (seconds) for that made a run that does nothing take 5 s of CPU
    code = ("import sys\nfrom astrai.recipe.command import load_recipe_spec\n"
            "load_recipe_spec('recipes/sft.yaml')\nprint('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
