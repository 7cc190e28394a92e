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


def _page_defaults(page: str, section: str) -> dict:
    """{dotted key: default cell} of one section's table in a generated reference page."""
    text = (ROOT / "docs" / "reference" / page).read_text(encoding="utf-8").split(f"## {section}\n", 1)[1]
    text = text.split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| [^|]*(?:\\\|[^|]*)* \| (.*?) \| ", text, re.M)}


def _flat(value, prefix="") -> dict:
    from pydantic import BaseModel

    out = {}
    for name in type(value).model_fields:
        v = getattr(value, name)
        if isinstance(v, BaseModel):
            out.update(_flat(v, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = v
    return out


def _verb_options(verb: str, argv: list):
    """The options a verb runs with when given only `argv`: parsed by its own command line."""
    from astrai.cli import build_parser
    from astrai.config.infer import EvalOptions, GenerateOptions
    from astrai.config.serve import ChatOptions, ServeOptions
    from astrai.infer.flags import build

    model = {"generate": GenerateOptions, "eval": EvalOptions, "serve": ServeOptions, "chat": ChatOptions}[verb]
    return build(model, build_parser().parse_args([verb, *argv]), [])


def test_reference_defaults_are_what_each_verb_runs_with():
    # the reference page's default of every key is the value the verb actually gets when the key is not
    # given: read from options built by the verb's own command line (or validated from a minimal file)
    from astrai.config.pipeline import Pipeline
    from astrai.config.train import TrainOptions

    cases = [("serve.md", "ChatOptions", _verb_options("chat", ["ckpt"])),
             ("serve.md", "ServeOptions", _verb_options("serve", ["ckpt"])),
             ("generate.md", "GenerateOptions", _verb_options("generate", ["ckpt", "--prompt", "x"])),
             ("generate.md", "EvalOptions", _verb_options("eval", ["ckpt", "--data", "d"])),
             ("train.md", "TrainOptions", TrainOptions.model_validate({"output": "out"})),
             ("pipeline.md", "Pipeline", Pipeline.model_validate({"version": 1, "input": {"format": "messages"}}))]
    checked = 0
    for page, section, options in cases:
        shown = _page_defaults(page, section)
        for key, value in _flat(options).items():
            if key not in shown or shown[key] in ("required", "(its defaults)") or key in ("prompt",
                                                                                             "checkpoint", "data"):
                continue
            want = "`null`" if value is None else f"`{value!r}`".replace("|", "\\|")
            assert shown[key] == want, f"docs/reference/{page} {section} {key}: {shown[key]}, the code: {want}"
            checked += 1
    assert checked > 60 and _page_defaults("serve.md", "ChatOptions")["sampling.max_tokens"] == "`512`"
