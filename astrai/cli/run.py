"""`astrai run RECIPE [--from NAME] [--only NAME] [--force] [--set stage.key=value]`.

The recipe (its stages under `stages:`) is validated whole, then run by astrai.recipe: each stage
skipped when up to date, resumed when interrupted, and a table at the end.
"""

from __future__ import annotations

import sys

from astrai.config import detect_kind, load_yaml

# finished units of work are kept (completion markers, checkpoints); what was half-written is redone
INTERRUPTED = "interrupted; rerun to resume"


def help_for(verb: str) -> str:
    return "run a recipe's stages (tokenizer, preprocess, train, eval ...), skipping what is up to date"


def add_arguments(p):
    from astrai.recipe.command import add_run_arguments

    add_run_arguments(p)


def run(args) -> int:
    if detect_kind(load_yaml(args.recipe)[0]) == "pipeline":
        print(f"error: {args.recipe} is a pipeline, not a recipe (use astrai preprocess)", file=sys.stderr)
        return 1
    from astrai.recipe.command import run as run_recipe

    return run_recipe(args)
