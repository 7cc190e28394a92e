"""Recipes as the verbs that take "a pipeline or a recipe" see them, with paths resolved in one place.

A recipe lists its stages under `stages:` (validated and run by astrai.recipe). `inspect`,
`validate` and `preprocess` read its first preprocess stage: `load_any` returns a `Loaded` that
resolves the tokenizer, template and input paths the same way for all of them. The run directory
rule (`run_dir_of`, `stage_output`) lives here too, so every verb finds a stage's output alike.

The older form, one top-level block per stage (`preprocess: {..., output: ...}`), is refused with
the same recipe rewritten under `stages:` (`old_form_error`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from astrai.config.loading import ConfigError, Problem, apply_overrides, find_mark, load_yaml, override, validate_data
from astrai.config.pipeline import Pipeline, load_pipeline

RECIPE_KEYS = ("version", "name", "run_dir", "stages")
OLD_FORM_KEYS = ("preprocess", "train", "eval", "generate")  # top-level stage blocks of the older form
STAGE_OUTPUT = "output"  # RUN/<stage>/output: what a stage of a recipe produces


def detect_kind(data: Any) -> str:
    """'recipe' or 'pipeline', from the top-level keys (a pipeline has none of a recipe's)."""
    if isinstance(data, dict) and ("stages" in data or any(k in data for k in OLD_FORM_KEYS)):
        return "recipe"
    return "pipeline"


def is_staged(data: Any) -> bool:
    """A recipe of named, chained stages (`stages:`), the one form astrai runs."""
    return isinstance(data, dict) and "stages" in data


def old_form_error(path, data: dict, marks: dict) -> ConfigError:
    """The older recipe form, refused with the same recipe written under `stages:`."""
    found = [k for k in OLD_FORM_KEYS if k in data]
    line, col = find_mark(marks, (found[0],), key=True)
    new, notes = _as_stages(data)
    import yaml

    text = yaml.safe_dump(new, sort_keys=False, default_flow_style=None, width=100).rstrip()
    shown = "\n      ".join(text.splitlines())
    message = (f"top-level stage blocks ({', '.join(found)}) are no longer read: a recipe lists its stages "
               f"under `stages:`, in the order they run; each writes RUN/<stage>/output (RUN is run_dir, "
               f"default runs/<name> beside the recipe) and a stage reads an earlier one by its name. This recipe "
               f"in that form (see recipes/sft.yaml):\n      {shown}" + "".join(f"\n    {n}" for n in notes))
    return ConfigError(str(path), [Problem(found[0], message, line, col)])


def _as_stages(data: dict) -> tuple[dict, list[str]]:
    """The older form's blocks rewritten as stages (outputs go to the run directory), with notes."""
    new = {k: data[k] for k in ("version", "name") if k in data}
    stages, notes = {}, []
    outputs = [f"{k}.output" for k in OLD_FORM_KEYS if isinstance(data.get(k), dict) and data[k].get("output")]
    if outputs:
        notes.append(f"{', '.join(outputs)}: gone; outputs go to the run directory (set run_dir: to choose it)")
    pre = data.get("preprocess")
    if isinstance(pre, dict):
        stages["preprocess"] = {k: v for k, v in pre.items() if k != "output"}
    train = data.get("train")
    if isinstance(train, dict):
        block = {k: v for k, v in train.items() if k != "output"}
        if pre is not None:  # the older train read the preprocess output by default
            block = {"data": "preprocess", **{k: v for k, v in block.items() if k != "data"}}
        stages["train"] = block
    ev = data.get("eval")
    if isinstance(ev, dict):
        block = {k: v for k, v in ev.items() if k not in ("output", "checkpoint", "data")}
        refs = {"model": "train"} if train is not None else {"model": ev.get("checkpoint")}
        refs["data"] = "preprocess" if pre is not None else ev.get("data")
        if pre is not None and not (isinstance(pre, dict) and pre.get("holdout")):
            refs["split"] = "train"  # the older eval read the whole output; `holdout: 0.1` gives a val split
        stages["eval"] = {**refs, **block}
    if "generate" in data:
        notes.append("generate: not a recipe stage; run it after the recipe: astrai generate "
                     "RUN/train/output/final --chat FILE.jsonl")
    new["stages"] = stages
    return new, notes


def run_dir_of(recipe_path: str | os.PathLike, data: dict) -> Path:
    """A recipe's run directory: run_dir, relative to the recipe file (default runs/<name>)."""
    run_dir = data.get("run_dir") or Path("runs") / str(data.get("name") or Path(recipe_path).stem)
    return Path(os.path.normpath(Path(recipe_path).resolve().parent / str(run_dir)))


def stage_output(recipe_path: str | os.PathLike, data: dict, name: str) -> Path:
    """Where stage `name` of a recipe writes (the one home of this rule; astrai.recipe uses it)."""
    return run_dir_of(recipe_path, data) / name / STAGE_OUTPUT


def recipe_path(recipe_dir: Path, rel: str) -> str:
    """A path written in a recipe, relative to the recipe file (package:NAME and absolute kept)."""
    if rel.startswith("package:") or Path(rel).is_absolute():
        return rel
    return os.path.normpath(Path(recipe_dir) / rel)


def split_overrides(overrides, stage_names) -> tuple[list[str], list[str]]:
    """A recipe's `--set`s: those for its stages and top-level keys, and those for the pipeline of its
    preprocess stages (`pipeline.KEY=...`, or a pipeline key that is neither a stage nor a recipe key)."""
    stage, pipe = [], []
    for expr in overrides:
        head = expr.split("=", 1)[0].split(".", 1)[0].strip()
        if head == "pipeline" and "pipeline" not in stage_names:
            pipe.append(expr.split(".", 1)[1] if "." in expr.split("=", 1)[0] else expr)
        elif head in Pipeline.model_fields and head not in stage_names and head not in RECIPE_KEYS:
            pipe.append(expr)
        else:
            stage.append(expr)
    return stage, pipe


def _staged_preprocess(path, data: dict, marks: dict, overrides) -> "Loaded":
    """The first preprocess stage of a recipe, as `inspect` and `validate` need it. A tokenizer that
    names a tokenizer stage is that stage's output, which exists once it has run; one that names a
    checkpoint stage is the checkpoint's (a `package:` checkpoint stays named so: the verb converts it,
    astrai.recipe.checkpoint_stage.tokenizer_source)."""
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    stage_sets, pipe_sets = split_overrides(overrides, list(stages))
    if stage_sets:
        try:
            apply_overrides(stages, [o for o in stage_sets if o.split(".", 1)[0] in stages])
        except ValueError as e:
            raise ConfigError(str(path), [Problem("--set", str(e))]) from None
    name = next((n for n, b in stages.items() if isinstance(b, dict) and b.get("kind", n) == "preprocess"), None)
    if name is None:
        raise ConfigError(str(path), [Problem("stages", "this recipe has no preprocess stage", *find_mark(marks, ("stages",)))])
    block = stages[name]
    base = Path(path).parent
    pipe_path = base / str(block.get("pipeline", ""))
    if not pipe_path.is_file():
        line, col = find_mark(marks, ("stages", name, "pipeline"))
        raise ConfigError(str(path), [Problem(f"stages.{name}.pipeline", f"file not found: {pipe_path}", line, col)])
    tok = block.get("tokenizer")
    if isinstance(tok, str) and tok in stages:
        out = _tokenizer_of_stage(path, data, tok)
        if isinstance(out, str):  # a packaged checkpoint
            tok = out
        elif not (out / "tokenizer.json").exists():
            line, col = find_mark(marks, ("stages", name, "tokenizer"))
            raise ConfigError(str(path), [Problem(f"stages.{name}.tokenizer", f"the tokenizer of stage '{tok}' is "
                                                  f"made by running it: astrai run {path} --only {tok}", line, col)])
        else:
            tok = str(out)
    elif isinstance(tok, str):
        tok = _tokenizer_path(base, tok)
    inputs = [recipe_path(base, i) for i in block.get("inputs") or []]
    fmt = block.get("format")
    pipeline = load_pipeline(pipe_path, tuple(list(block.get("overrides") or []) + list(pipe_sets)),
                             input_format=fmt if isinstance(fmt, str) else None)
    return Loaded(pipeline, pipe_path, base, tuple(inputs), tok)


def _tokenizer_of_stage(path, data: dict, name: str):
    """Where the tokenizer a stage makes is: its output (the directory its finished run points to, if
    any), or for a checkpoint stage the checkpoint: a directory as written, or its `package:NAME`."""
    block = data["stages"][name]
    given = block.get("path") if isinstance(block, dict) and block.get("kind", name) == "checkpoint" else None
    if isinstance(given, str):
        return given if given.startswith("package:") else Path(recipe_path(Path(path).parent, given))
    out = stage_output(path, data, name)
    try:
        pointed = json.loads((out.parent / "metrics.json").read_text()).get("points_to")
    except (OSError, ValueError, AttributeError):
        pointed = None
    return Path(pointed) if isinstance(pointed, str) else out


def _tokenizer_path(recipe_dir: Path, rel: str) -> str:
    """A recipe's tokenizer: absolute (it is later loaded next to the pipeline's own relative paths)."""
    return rel if rel.startswith("package:") else os.path.abspath(recipe_path(recipe_dir, rel))


@dataclass(frozen=True)
class Loaded:
    """A pipeline file, or a recipe's preprocess stage with its pipeline, with paths resolved the way
    every verb needs."""

    pipeline: Pipeline
    pipeline_path: Path
    recipe_dir: Optional[Path] = None  # set when loaded from a recipe
    recipe_inputs_: tuple = ()  # the recipe's preprocess stage's inputs and tokenizer
    recipe_tokenizer: Optional[str] = None

    @property
    def is_recipe(self) -> bool:
        return self.recipe_dir is not None

    @property
    def base_dir(self) -> str:
        """Where the pipeline's own relative paths (a .jinja template, a tokenizer dir) are resolved."""
        return str(self.pipeline_path.parent)

    @property
    def recipe_inputs(self) -> list[str]:
        return list(self.recipe_inputs_)

    def tokenizer(self, command_line: Optional[str] = None) -> Optional[str]:
        """The tokenizer to load (with base_dir): --tokenizer (relative to the working directory, else to
        the pipeline), else the recipe's (relative to the recipe), else the pipeline's own."""
        if command_line:
            if command_line.startswith("package:"):
                return command_line
            p = Path(command_line)
            return str((p if p.exists() else self.pipeline_path.parent / p).resolve())
        return self.recipe_tokenizer or self.pipeline.tokenizer


def load_any(path: str | os.PathLike, overrides: tuple[str, ...] = ()) -> Loaded:
    """Load a pipeline, or a recipe's first preprocess stage with its pipeline (by the file's keys);
    on a recipe, pipeline keys (`pipeline.KEY=...` or a bare pipeline key) go to that pipeline."""
    data, marks = load_yaml(path)
    if detect_kind(data) == "pipeline":
        sets = override(data, overrides, path)
        return Loaded(validate_data(data, Pipeline, str(path), marks, sets), Path(path))
    if not is_staged(data):
        raise old_form_error(path, data, marks)
    return _staged_preprocess(path, data, marks, overrides)
