"""`astrai run RECIPE [--from NAME] [--only NAME] [--force] [--set stage.key=value]`.

Everything is validated before any work: the recipe, every stage's options, every reference and
input, and (for --from/--only) that the stages not selected but read are done and current. Then
the runner goes through the stages, skipping the up-to-date ones, and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from astrai.config import ConfigError, apply_overrides, load_yaml


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `astrai run` besides --set (which every verb of the CLI gets)."""
    parser.add_argument("recipe", help="recipe YAML (stages in order; see recipes/)")
    parser.add_argument("--from", dest="from_stage", metavar="NAME",
                        help="run NAME and every stage after it (the ones before must be done and current)")
    parser.add_argument("--only", metavar="NAME", help="run only stage NAME (what it reads must be done and current)")
    parser.add_argument("--force", action="store_true", help="rerun the selected stages even when up to date")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.KEY=VALUE",
                        help="override a stage option (typed as YAML), e.g. --set train.lr=1e-3; repeatable")


def load_recipe_spec(path: str, overrides=(), kinds: Optional[dict] = None):
    """Load, override (`stage.key=value`) and fully validate a recipe; raise ConfigError."""
    from astrai.config import OLD_FORM_KEYS, Problem, old_form_error, split_overrides
    from astrai.recipe.builtin import recipe_kinds
    from astrai.recipe.spec import parse_recipe, stage_overrides

    kinds = kinds if kinds is not None else recipe_kinds()
    data, marks = load_yaml(path)
    if isinstance(data, dict) and "stages" not in data and any(k in data for k in OLD_FORM_KEYS):
        raise old_form_error(path, data, marks)
    applied: list[tuple[str, str]] = []  # (the key an override set, the override as written)
    if isinstance(data, dict) and overrides:
        names = list(data.get("stages") or {}) if isinstance(data.get("stages"), dict) else []
        overrides, pipeline_keys = split_overrides(overrides, names)
        rewritten = stage_overrides(overrides, names)
        try:
            apply_overrides(data, rewritten)
        except ValueError as e:
            raise ConfigError(str(path), [Problem("--set", str(e))]) from None
        applied = [(expr.split("=", 1)[0].strip(), shown) for expr, shown in zip(rewritten, overrides)]
        _to_preprocess_stages(data, pipeline_keys, path)
    try:
        return parse_recipe(data, marks, str(path), kinds), kinds
    except ConfigError as e:  # a problem under a key a --set gave is named by that --set, not a file line
        raise ConfigError(e.file, [_named_by_set(p, applied) for p in e.problems]) from None


def _named_by_set(p, applied):
    from astrai.config import Problem

    for key, shown in reversed(applied):  # the last override of a key is the one in effect
        if p.path == key or p.path.startswith((key + ".", key + "[")):
            return Problem(f"--set {shown}", f"{p.path}: {p.message}")
    return p


def _to_preprocess_stages(data: dict, pipeline_keys: list[str], path):
    """Append pipeline overrides to every preprocess stage's own (after them, so the command line wins);
    their errors are then named by their `--set` (astrai.config.loading.validate_data)."""
    from astrai.config import Problem

    if not pipeline_keys:
        return
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    targets = [opts for name, opts in stages.items() if isinstance(opts, dict) and opts.get("kind", name) == "preprocess"]
    if not targets:
        raise ConfigError(str(path), [Problem(f"--set {o}", "a pipeline key, but this recipe has no preprocess stage")
                                      for o in pipeline_keys])
    for opts in targets:
        opts["overrides"] = list(opts.get("overrides") or []) + pipeline_keys


def run(args) -> int:
    from astrai.errors import InputError
    from astrai.recipe.rundir import RunDirError
    from astrai.recipe.runner import Runner

    try:
        recipe, kinds = load_recipe_spec(args.recipe, tuple(args.overrides))
        args.output = str(recipe.run_dir)  # named by astrai.cli.main when the disk fills up there
        Runner(recipe, kinds).run(from_stage=args.from_stage, only=args.only, force=args.force)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (InputError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="astrai run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
