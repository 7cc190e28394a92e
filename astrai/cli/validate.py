"""`astrai validate FILE`: print OK, or every problem with its key path and line:column (exit 1)."""

from __future__ import annotations

from astrai.config import ConfigError, is_staged, load_any, load_yaml


def help_for(verb: str) -> str:
    return "check a pipeline or recipe; print OK or every problem (exit 1)"


def add_arguments(p):
    p.add_argument("file", help="pipeline or recipe YAML")


def run(args) -> int:
    try:
        if is_staged(load_yaml(args.file)[0]):  # chained stages: every stage, reference and input checked
            from astrai.recipe.command import load_recipe_spec

            load_recipe_spec(args.file, tuple(args.overrides))
        else:
            load_any(args.file, tuple(args.overrides))
    except ConfigError as e:
        for p in e.problems:
            print(f"{e.file}:{p}")
        print(f"{len(e.problems)} problem(s)")
        return 1
    print(f"{args.file}: OK")
    return 0
