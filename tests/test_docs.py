"""The documentation stays true: the reference pages are what the option models generate, every
link and file they name exists, and the README's recipe excerpt and run paths match the recipe."""

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_reference_pages_are_the_generated_ones():
    spec = importlib.util.spec_from_file_location("make_reference", ROOT / "docs" / "make_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, text in mod.render().items():
        committed = (ROOT / "docs" / "reference" / name).read_text(encoding="utf-8")
        assert committed == text, f"docs/reference/{name} is out of date: run python docs/make_reference.py"


def test_the_reference_lists_every_pipeline_key():
    from astrai.config.pipeline import Preprocessing, Section

    page = (ROOT / "docs" / "reference" / "pipeline.md").read_text(encoding="utf-8")
    for name in Section.model_fields:
        assert f"| `{name}` |" in page
    for name in Preprocessing.model_fields:
        assert f"| `preprocessing.{name}` |" in page


def test_every_relative_link_exists():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


def _excerpt(text: str) -> dict:
    """The first YAML block that is a recipe."""
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        data = yaml.safe_load(block)
        if isinstance(data, dict) and "stages" in data:
            return data
    raise AssertionError("no recipe excerpt")


def test_recipe_excerpts_match_the_bundled_recipe():
    recipe = yaml.safe_load((ROOT / "recipes" / "sft.yaml").read_text())
    for doc in (ROOT / "README.md", ROOT / "docs" / "recipes.md"):
        shown = _excerpt(doc.read_text(encoding="utf-8"))
        assert list(shown["stages"]) == list(recipe["stages"]), doc
        for stage, block in shown["stages"].items():
            for key, value in block.items():
                assert recipe["stages"][stage].get(key) == value, f"{doc.name}: {stage}.{key}"


def test_run_paths_in_the_readme_are_what_the_recipe_writes():
    # runs/sft/<stage>/output/<what>: a stage of recipes/sft.yaml and something that stage writes
    writes = {"checkpoint": {""}, "tokenizer": {""}, "preprocess": {"train", "val"}, "train": {"final", "checkpoints"}, "eval": {""}}
    kinds = {name: block.get("kind", name)
             for name, block in yaml.safe_load((ROOT / "recipes" / "sft.yaml").read_text())["stages"].items()}
    text = "\n".join(d.read_text(encoding="utf-8") for d in DOCS)
    found = re.findall(r"runs/sft/([\w.-]+)(?:/([\w.-]+))?(?:/([\w.-]+))?", text)
    assert found
    for stage, sub, what in found:
        if stage in ("loss.png", "summary.json", "<stage>") or stage.startswith("<"):
            continue
        assert stage in kinds, f"runs/sft/{stage}: no such stage in recipes/sft.yaml"
        if sub:
            assert sub == "output", f"runs/sft/{stage}/{sub}"
            assert what in writes[kinds[stage]] or not what, f"runs/sft/{stage}/output/{what}"
