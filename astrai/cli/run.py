"""`astrai run RECIPE`: validate the whole recipe (and its pipeline), then run its stages in
registry order (astrai.config.stages), each through the stage's own run function."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from astrai.config import STAGES, Recipe, StageContext, load_any, model_help, split_overrides


def help_for(verb: str) -> str:
    return "run a recipe's stages (preprocess; train/eval/generate when they land)"


def add_arguments(p):
    p.epilog = "recipe keys (--set KEY=VALUE; pipeline keys as pipeline.KEY):\n" + "\n".join(model_help(Recipe))
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/sft.yaml")


def run(args) -> int:
    cfg = load_any(args.recipe, tuple(args.overrides))  # every problem of recipe and pipeline, before any work
    if cfg.recipe is None:
        print(f"error: {args.recipe} is a pipeline, not a recipe (use astrai preprocess)", file=sys.stderr)
        return 1
    _, pipeline_overrides = split_overrides(args.overrides)
    ctx = StageContext(Path(args.recipe).parent, tuple(pipeline_overrides))
    for stage in STAGES.values():
        options = getattr(cfg.recipe, stage.name)
        if options is None:
            continue
        t0 = time.time()
        print(f"[{stage.name}] {stage.help}")
        result = stage.run_function()(options, ctx)
        if result is not None:
            ctx.outputs[stage.name] = str(result)
        print(f"[{stage.name}] done in {time.time() - t0:.1f}s")
    return 0
