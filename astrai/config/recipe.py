"""The recipe model and loading a pipeline-or-recipe with its paths resolved in one place.

A recipe chains stages (`preprocess:`, then `train:`, `eval:` ... when they land). Its model has
one typed field per stage of the registry (astrai.config.stages), so a stage's block is checked
by that stage's options model like any other config, before anything runs.

`load_any` is what every verb that accepts "a pipeline or a recipe" calls; the `Loaded` it
returns resolves the tokenizer and template paths the same way for all of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, create_model, model_validator

from astrai.config.loading import (
    ConfigError, Problem, StrictModel, find_mark, get_in, load_yaml, override, raise_combination_problems,
    validate_data,
)
from astrai.config.pipeline import Pipeline, load_pipeline, tokenizer_problems
from astrai.config.stages import STAGES, StageContext


class _RecipeBase(StrictModel):
    version: Literal[1] = Field(description="recipe format version")
    name: Optional[str] = Field(None, description="a name for logs")

    @model_validator(mode="after")
    def _combinations(self):
        return raise_combination_problems(self)

    @classmethod
    def combination_problems(cls, data: Any) -> list[tuple[tuple, str]]:
        return recipe_combination_problems(data)


def _stage_field(stage):
    if stage.recipe_only:
        return Optional[dict[str, Any]], Field(None, description=f"(only under `stages:`: {stage.help})")
    if not stage.landed:
        # declared so that the problem is "not available yet", not "unknown key"
        return Optional[dict[str, Any]], Field(None, description=f"(not available yet: {stage.help})")
    if stage.required:
        return stage.options, Field(description=stage.help)
    return Optional[stage.options], Field(None, description=stage.help)


def recipe_model(stages: dict) -> type[StrictModel]:
    """The recipe model for a stage registry: each stage's block checked by the stage's options model."""
    model = create_model("Recipe", __base__=_RecipeBase,
                         **{s.name: _stage_field(s) for s in stages.values()})
    model.__doc__ = "A recipe: one block per stage (astrai.config.stages), each checked by its options model."
    return model


Recipe = recipe_model(STAGES)


def recipe_combination_problems(data: Any) -> list[tuple[tuple, str]]:
    out = [((s.name,), f"stage '{s.name}' is not available in this version of astrai yet; remove it from the recipe")
           for s in STAGES.values() if not s.landed and get_in(data, s.name) is not None]
    out += [((s.name,), f"stage '{s.name}' runs in recipes of named stages: put the recipe's stages under "
                        f"`stages:` (see recipes/sft.yaml)")
            for s in STAGES.values() if s.recipe_only and get_in(data, s.name) is not None]
    # the stages' own combination checks, with their key paths under the stage's block
    for s in STAGES.values():
        check = getattr(s.options, "combination_problems", None)
        block = get_in(data, s.name)
        if check is not None and isinstance(block, dict):
            out.extend(((s.name, *loc), msg) for loc, msg in check(block))
    return out + tokenizer_problems(data, ("preprocess", "tokenizer"))


def load_recipe(path: str | os.PathLike, overrides: tuple[str, ...] = ()) -> Recipe:
    data, marks = load_yaml(path)
    sets = override(data, overrides, path)
    return validate_data(data, Recipe, str(path), marks, sets)


def detect_kind(data: Any) -> str:
    """'recipe' or 'pipeline', from the top-level keys (a recipe's keys are stage names, or `stages`)."""
    legacy = [name for name, s in STAGES.items() if not s.recipe_only]  # a pipeline has a tokenizer: key too
    if isinstance(data, dict) and (is_staged(data) or any(name in data for name in legacy)):
        return "recipe"
    return "pipeline"


def is_staged(data: Any) -> bool:
    """A recipe of named, chained stages (`stages:`; run by astrai.recipe) rather than top-level blocks."""
    return isinstance(data, dict) and "stages" in data


STAGE_OUTPUT = "output"  # RUN/<stage>/output: what a stage of a `stages:` recipe produces


def run_dir_of(recipe_path: str | os.PathLike, data: dict) -> Path:
    """A `stages:` recipe's run directory: run_dir, relative to the recipe file (default runs/<name>)."""
    run_dir = data.get("run_dir") or Path("runs") / str(data.get("name") or Path(recipe_path).stem)
    return Path(os.path.normpath(Path(recipe_path).resolve().parent / str(run_dir)))


def stage_output(recipe_path: str | os.PathLike, data: dict, name: str) -> Path:
    """Where stage `name` of a `stages:` recipe writes (the one home of this rule; astrai.recipe uses it)."""
    return run_dir_of(recipe_path, data) / name / STAGE_OUTPUT


def _staged_preprocess(path, data: dict, marks: dict, overrides) -> "Loaded":
    """The first preprocess stage of a `stages:` recipe, as `inspect` and `validate` need it. A tokenizer
    that names a stage is that stage's output, which exists once it has run."""
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
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
        out = stage_output(path, data, tok)
        if not (out / "tokenizer.json").exists():
            line, col = find_mark(marks, ("stages", name, "tokenizer"))
            raise ConfigError(str(path), [Problem(f"stages.{name}.tokenizer", f"the tokenizer of stage '{tok}' is "
                                                  f"made by running it: astrai run {path} --only {tok}", line, col)])
        tok = str(out)
    elif isinstance(tok, str):
        tok = StageContext(base).tokenizer(tok)
    inputs = [StageContext(base).path(i) for i in block.get("inputs") or []]
    pipeline = load_pipeline(pipe_path, tuple(list(block.get("overrides") or []) + list(overrides)))
    return Loaded(None, pipeline, pipe_path, base, staged_inputs=tuple(inputs), staged_tokenizer=tok)


def split_overrides(overrides) -> tuple[list[str], list[str]]:
    """Recipe overrides, and the `pipeline.KEY=...` ones that go to the recipe's pipeline."""
    recipe = [o for o in overrides if not o.startswith("pipeline.")]
    pipe = [o[len("pipeline."):] for o in overrides if o.startswith("pipeline.")]
    return recipe, pipe


@dataclass(frozen=True)
class Loaded:
    """A pipeline file, or a recipe with its pipeline, with paths resolved the way every verb needs."""

    recipe: Optional[Recipe]
    pipeline: Pipeline
    pipeline_path: Path
    recipe_dir: Optional[Path] = None
    staged_inputs: tuple = ()  # a `stages:` recipe: its first preprocess stage's inputs and tokenizer
    staged_tokenizer: Optional[str] = None

    @property
    def is_recipe(self) -> bool:
        return self.recipe is not None or self.recipe_dir is not None

    @property
    def base_dir(self) -> str:
        """Where the pipeline's own relative paths (a .jinja template, a tokenizer dir) are resolved."""
        return str(self.pipeline_path.parent)

    def recipe_path(self, rel: str) -> str:
        """A path written in the recipe (inputs, output, tokenizer), relative to the recipe file."""
        return StageContext(self.recipe_dir).path(rel)

    @property
    def recipe_inputs(self) -> list[str]:
        if self.staged_inputs:
            return list(self.staged_inputs)
        return [self.recipe_path(i) for i in self.recipe.preprocess.inputs] if self.recipe else []

    def tokenizer(self, command_line: Optional[str] = None) -> Optional[str]:
        """The tokenizer to load (with base_dir): --tokenizer (relative to the working directory, else to
        the pipeline), else the recipe's (relative to the recipe), else the pipeline's own."""
        if command_line:
            if command_line.startswith("package:"):
                return command_line
            p = Path(command_line)
            return str((p if p.exists() else self.pipeline_path.parent / p).resolve())
        if self.staged_tokenizer:
            return self.staged_tokenizer
        tok = self.recipe.preprocess.tokenizer if self.recipe else None
        return StageContext(self.recipe_dir).tokenizer(tok) if tok else self.pipeline.tokenizer


def load_any(path: str | os.PathLike, overrides: tuple[str, ...] = ()) -> Loaded:
    """Load a pipeline or a recipe (by its keys). For a recipe, its pipeline is loaded and checked too,
    and `pipeline.KEY=...` overrides go to that pipeline."""
    data, marks = load_yaml(path)
    if detect_kind(data) != "recipe":
        sets = override(data, overrides, path)
        return Loaded(None, validate_data(data, Pipeline, str(path), marks, sets), Path(path))
    r_over, p_over = split_overrides(overrides)
    if is_staged(data):
        return _staged_preprocess(path, data, marks, p_over)
    _refuse_pipeline_keys(path, r_over)
    sets = override(data, r_over, path)
    recipe = validate_data(data, Recipe, str(path), marks, sets)
    pipe_path = Path(path).parent / recipe.preprocess.pipeline
    if not pipe_path.exists():
        line, col = find_mark(marks, ("preprocess", "pipeline"))
        raise ConfigError(str(path), [Problem("preprocess.pipeline", f"file not found: {pipe_path}", line, col)])
    return Loaded(recipe, load_pipeline(pipe_path, tuple(p_over), "pipeline."), pipe_path, Path(path).parent)


def _refuse_pipeline_keys(path, overrides):
    """A pipeline key set on a recipe (--set preprocessing.max_seq_len=...): say the form that works."""
    problems = []
    for o in overrides:
        top = o.split("=", 1)[0].strip().split(".")[0]
        if top in Pipeline.model_fields and top not in Recipe.model_fields:
            problems.append(Problem(f"--set {o}", f"'{top}' is a key of the recipe's pipeline: on a recipe write "
                                                  f"--set pipeline.{o}"))
    if problems:
        raise ConfigError(str(path), problems)
