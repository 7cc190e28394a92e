"""`astrai run RECIPE [--from NAME] [--only NAME] [--force] [--set stage.key=value]`.

A recipe of named stages (`stages:`) is validated whole, then run by astrai.recipe: each stage
skipped when up to date, resumed when interrupted, and a table at the end. The older form (one
top-level block per stage, preprocess only) still runs its blocks in registry order.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from astrai.config import STAGES, StageContext, is_staged, load_any, load_yaml, split_overrides


def help_for(verb: str) -> str:
    return "run a recipe's stages (tokenizer, preprocess, train, eval ...), skipping what is up to date"


def add_arguments(p):
    from astrai.recipe.command import add_run_arguments

    add_run_arguments(p)


def run(args) -> int:
    if is_staged(load_yaml(args.recipe)[0]):
        from astrai.recipe.command import run as run_staged

        return run_staged(args)
    if args.from_stage or args.only or args.force:
        print("error: --from/--only/--force need a recipe of named stages (`stages:`, see recipes/)",
              file=sys.stderr)
        return 1
    cfg = load_any(args.recipe, tuple(args.overrides))  # every problem of recipe and pipeline, before any work
    if cfg.recipe is None:
        print(f"error: {args.recipe} is a pipeline, not a recipe (use astrai preprocess)", file=sys.stderr)
        return 1
    _, pipeline_overrides = split_overrides(args.overrides)
    ctx = StageContext(Path(args.recipe).parent, tuple(pipeline_overrides))
    for stage in STAGES.values():
        options = None if stage.recipe_only else getattr(cfg.recipe, stage.name)
        if options is None:
            continue
        t0 = time.time()
        print(f"[{stage.name}] {stage.help}")
        result = stage.run_function()(options, ctx)
        if result is not None:
            ctx.outputs[stage.name] = str(result)
        print(f"[{stage.name}] done in {time.time() - t0:.1f}s")
    return 0
