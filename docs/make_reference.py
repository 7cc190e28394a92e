"""Write docs/reference/*.md from the option models, so the reference cannot drift from the code.

    python docs/make_reference.py           # (re)write the reference pages
    python docs/make_reference.py --check   # exit 1 when a committed page differs (tests/test_docs.py)

Every key of a pipeline, a recipe stage, `astrai train`, `astrai generate`/`eval` and `astrai serve`/`chat` is declared
once, in a pydantic model with its default and a one-line meaning (astrai.config, astrai.recipe);
this script renders those declarations as tables. Change a model, rerun it, commit both.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference"
NESTED_OWN_TABLE = ("sections", "sources")  # lists/maps of models: a table of their own


def type_text(ann) -> str:
    """A readable type: `int`, `int or null`, `train | mask`, `list of str`, `map of str -> str`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:  # PositiveInt and the like: the type, its bounds are in the meaning
        return type_text(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_text(args[0])} -> {type_text(args[1])}" if args else "map"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return f"[{ann.__name__}](#{ann.__name__.lower()})"
    return getattr(ann, "__name__", str(ann)).replace("NoneType", "null")


def default_text(f, holder=None, name: str = "") -> str:
    """The default as the code applies it: a key of a block whose default is a model instance takes
    that instance's value (chat's `sampling` block defaults max_tokens to 512, not SamplingParams' 16)."""
    if f.is_required() and holder is None:
        return "required"
    value = getattr(holder, name) if holder is not None else f.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(its defaults)"
    return "`null`" if value is None else f"`{value!r}`".replace("|", "\\|")


def _model_of(ann):
    """The model a field holds directly (Optional[Model] included), else None."""
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def table(model: type[BaseModel], prefix: str = "", skip=(), holder=None) -> list[str]:
    """`holder`: the default instance of the block being flattened (its values are the defaults)."""
    rows = []
    for name, f in model.model_fields.items():
        if name in skip:
            continue
        sub = _model_of(f.annotation)
        meaning = (f.description or "").replace("|", "\\|")
        if sub is not None and name not in NESTED_OWN_TABLE and sub is not model:
            default = getattr(holder, name) if holder is not None else \
                (None if f.is_required() else f.get_default(call_default_factory=True))
            if not f.is_required() and default is None:  # an optional block
                rows.append(f"| `{prefix}{name}` | block or null | `null` | {meaning} (its keys below) |")
            # a block of keys: flattened, dotted, each with the default its block's default instance has
            rows += table(sub, f"{prefix}{name}.", holder=default if isinstance(default, BaseModel) else None)
            continue
        rows.append(f"| `{prefix}{name}` | {type_text(f.annotation)} | {default_text(f, holder, name)} | {meaning} |")
    return rows


def section(title: str, model: type[BaseModel], intro: str = "", prefix: str = "", skip=()) -> list[str]:
    out = [f"## {title}", ""]
    if intro:
        out += [intro, ""]
    return out + ["| key | type | default | meaning |", "|---|---|---|---|", *table(model, prefix, skip), ""]


def header(title: str, intro: str) -> list[str]:
    return [f"# {title}", "", "Generated from the option models by `python docs/make_reference.py`; do not edit by hand.",
            "", intro, ""]


def pipeline_page() -> str:
    from astrai.config.pipeline import InputConfig, Output, Pipeline, Preprocessing, Section, Source

    lines = header("Pipeline keys", "A pipeline YAML (`astrai preprocess PIPELINE`, or a recipe's preprocess "
                   "stage). Any key can also be set from the command line: `--set preprocessing.max_seq_len=1024`. "
                   "How to write one: [../pipelines.md](../pipelines.md).")
    lines += section("Pipeline", Pipeline, "The top level.", skip=("input", "preprocessing", "output"))
    lines += section("InputConfig", InputConfig, "`input:` (give `sections` or `sources`).", "input.")
    lines += section("Section", Section, "Each item of `input.sections` (or of `input.sources.NAME.sections`).")
    lines += section("Source", Source, "`input.sources.NAME` (multi-output pipelines: DPO pairs, GRPO groups).")
    lines += section("Preprocessing", Preprocessing, "`preprocessing:`.", "preprocessing.")
    lines += section("Output", Output, "`output:`.", "output.")
    return "\n".join(lines)


def recipe_page() -> str:
    from astrai.recipe.builtin import recipe_kinds

    lines = header("Recipe stage keys", "A recipe (`astrai run RECIPE`) has `version: 1`, an optional `name` and "
                   "`run_dir` (relative to the recipe; default `runs/<name>`), and `stages:`, a map of stage name -> "
                   "options in the order they run. A stage's `kind` defaults to its name. Option paths are relative "
                   "to the recipe file; a stage reads an earlier one by its name. How to write one: "
                   "[../recipes.md](../recipes.md).")
    for name, kind in recipe_kinds().items():
        lines += section(f"kind: {name}", kind.options, f"Produces: {kind.produces}.")
    return "\n".join(lines)


def train_page() -> str:
    from astrai.config.train import TrainOptions

    lines = header("Training keys", "`astrai train CONFIG.yaml` (paths relative to the file) and a recipe's train "
                   "stage read these (a recipe names `data`, `val_data` and `model` by stage and decides "
                   "`output`). Guide: [../training.md](../training.md).")
    return "\n".join(lines + section("TrainOptions", TrainOptions))


def generate_page() -> str:
    from astrai.config import infer

    lines = header("Generation and eval keys", "`astrai generate` and `astrai eval` flags are these keys "
                   "(`--max-tokens` for `max_tokens`); a recipe's eval stage takes the eval keys. Guide: "
                   "[../generation.md](../generation.md).")
    for name in ("GenerateOptions", "EvalOptions", "SamplingParams", "EngineOptions"):
        model = getattr(infer, name, None)
        if model is not None:
            lines += section(name, model)
    return "\n".join(lines)


def serve_page() -> str:
    from astrai.config.serve import ChatOptions, ServeOptions

    lines = header("Serve and chat keys", "`astrai serve` and `astrai chat` flags are these keys (`--api-key` for "
                   "`api_key`; the engine's as in [generate.md](generate.md): `--page-size`, ...). Guide: the README's "
                   "Serve section.")
    return "\n".join(lines + section("ServeOptions", ServeOptions) + section("ChatOptions", ChatOptions))


PAGES = {"pipeline.md": pipeline_page, "recipe.md": recipe_page, "train.md": train_page,
         "generate.md": generate_page, "serve.md": serve_page}


def render() -> dict[str, str]:
    return {name: make().rstrip() + "\n" for name, make in PAGES.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python docs/make_reference.py and commit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
