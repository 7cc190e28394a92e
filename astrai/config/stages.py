"""The stage registry: every stage a recipe can hold and every stage verb of the CLI, in one place.

A stage is a name, the pydantic model of its recipe block (its options), the function that runs
it, and the CLI verb module that runs it on its own. The recipe model (astrai.config.recipe) gets
one typed, optional field per stage from here; `astrai run RECIPE` validates the whole recipe and
then runs the stages it declares in registry order; the CLI registers one verb per stage. Nothing
else knows the list.

Adding a stage (train, eval, generate are next):
1. Declare its options model below (a `StrictModel`: each field with its default and a one-line
   meaning; combination checks as a `combination_problems(data)` classmethod beside it, see
   astrai.config.loading). Options models live here, in the config layer, so loading a recipe
   never imports torch or the stage's code.
2. Write the stage as one module with `run(options, ctx: StageContext) -> Optional[str]`, e.g.
   astrai/train/stage.py (returning what it wrote, e.g. a checkpoint directory; a later stage of
   the same recipe finds it in `ctx.outputs["train"]`, as train finds the shards in
   `ctx.outputs["preprocess"]`), and a CLI verb module astrai/cli/train.py (`add_arguments`, `run`).
3. Replace its `Stage(...)` entry in STAGES with the options model and the two dotted paths.
Stages that have not landed yet have no options model: a recipe declaring one is rejected with a
clear problem, and their verb exits 2 saying so.

Run functions are named by dotted path ("module:function") and imported only when the stage
runs: the registry is plain data, so this layer never imports the layers above it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from pydantic import Field, model_validator

from astrai.config.infer import EvalOptions, GenerateOptions
from astrai.config.loading import StrictModel, get_in, raise_combination_problems


class PreprocessOptions(StrictModel):
    """A recipe's `preprocess:` block. Paths are relative to the recipe file."""

    pipeline: str = Field(description="pipeline YAML path, relative to the recipe file")
    inputs: list[str] = Field(description="input files or globs, relative to the recipe file")
    output: str = Field(description="output directory, relative to the recipe file")
    tokenizer: Optional[str] = Field(None, description="overrides the pipeline's tokenizer")
    workers: Optional[int] = Field(None, gt=0, description="parallel workers; default: number of cores")
    executor: Literal["local", "ray"] = Field(
        "local", description="local (process pool) | ray (a task per partition and per shard on a Ray cluster; "
                             "needs astrai[ray] and shared storage, docs/ray.md)")
    ray_address: Optional[str] = Field(
        None, description="Ray cluster address HOST:PORT (executor: ray); default: RAY_ADDRESS, else a private "
                          "local Ray")

    @model_validator(mode="after")
    def _combinations(self):
        return raise_combination_problems(self)

    @classmethod
    def combination_problems(cls, data: Any) -> list[tuple[tuple, str]]:
        if get_in(data, "ray_address") is not None and get_in(data, "executor", default="local") != "ray":
            return [(("ray_address",), "ray_address is only used with executor: ray (set it, or remove ray_address)")]
        return []


@dataclass(frozen=True)
class StageContext:
    """What every stage run gets besides its options: where the recipe is, the `pipeline.KEY=...`
    overrides of the command line, where to log, and what the earlier stages of the run wrote."""

    recipe_dir: Path
    pipeline_overrides: tuple[str, ...] = ()
    log: Callable[[str], None] = print
    outputs: dict[str, str] = field(default_factory=dict)  # stage name -> what its run returned

    def path(self, rel: str) -> str:
        """A path written in the recipe, relative to the recipe file (package:NAME and absolute kept)."""
        if rel.startswith("package:") or Path(rel).is_absolute():
            return rel
        return os.path.normpath(self.recipe_dir / rel)

    def tokenizer(self, rel: str) -> str:
        """A recipe's tokenizer: absolute (it is later loaded next to the pipeline's own relative paths)."""
        return rel if rel.startswith("package:") else os.path.abspath(self.path(rel))


@dataclass(frozen=True)
class Stage:
    name: str  # the recipe key and the CLI verb
    help: str  # one line, for --help and messages
    options: Optional[type[StrictModel]] = None  # None: not landed yet
    run: Optional[str] = None  # "module:function", called as function(options, ctx)
    verb: Optional[str] = None  # the CLI module of the verb (add_arguments, run)
    required: bool = False  # every recipe must declare it
    # "module:name" of the stage's recipe facts (astrai.recipe.kinds.StageKind: what it produces and
    # reads, its checks): how `astrai run` chains it with other stages under `stages:`
    recipe_kind: Optional[str] = None

    @property
    def landed(self) -> bool:
        return self.options is not None or self.recipe_only

    @property
    def recipe_only(self) -> bool:
        """A stage that runs only inside `stages:` recipes (or as its own verb), not as a top-level block."""
        return self.recipe_kind is not None and self.run is None

    def run_function(self) -> Callable:
        module, _, func = self.run.partition(":")
        return getattr(importlib.import_module(module), func)


STAGES: dict[str, Stage] = {s.name: s for s in (
    # Recipes written with `stages:` (astrai.recipe) name their stages and chain them, each kind's
    # facts in its recipe_kind; the older form, one top-level block per stage, still runs here.
    Stage("tokenizer", "byte-level BPE trained on the recipe's own records", None, None, None,
          recipe_kind="astrai.recipe.builtin:TOKENIZER"),
    Stage("preprocess", "records -> Parquet shards with exact labels", PreprocessOptions,
          "astrai.data.preprocess.stage:run", "astrai.cli.preprocess", required=True,
          recipe_kind="astrai.recipe.builtin:PREPROCESS"),
    # train runs in `stages:` recipes and as its verb; not as an older top-level block
    Stage("train", "training (pretrain/SFT/DPO/GRPO)", None, None, "astrai.cli.train",
          recipe_kind="astrai.recipe.builtin:train_kind"),
    Stage("eval", "perplexity on held-out preprocessed data + sample generations -> eval.json", EvalOptions,
          "astrai.infer.eval:run_stage", "astrai.cli.eval", recipe_kind="astrai.recipe.builtin:eval_kind"),
    Stage("generate", "continue text (--prompt) or answer conversations (--chat) with a checkpoint",
          GenerateOptions, "astrai.infer.generate:run_stage", "astrai.cli.generate"),
)}


def not_landed_message(stage: Stage) -> str:
    return f"{stage.help} has not landed yet"
