"""The preprocess stage as a recipe runs it: its `preprocess:` block (astrai.config.stages.
PreprocessOptions) with paths relative to the recipe, then run_preprocess."""

from __future__ import annotations

from pathlib import Path

from astrai.config.pipeline import load_pipeline
from astrai.config.stages import PreprocessOptions, StageContext
from astrai.data.preprocess.run import run_preprocess


def run(options: PreprocessOptions, ctx: StageContext) -> str:
    """Preprocess as the recipe says; return the output directory (for the stages after it)."""
    pipe_path = Path(ctx.recipe_dir) / options.pipeline
    pipeline = load_pipeline(pipe_path, ctx.pipeline_overrides)
    out = ctx.path(options.output)
    run_preprocess(pipeline, [ctx.path(i) for i in options.inputs], out,
                   tokenizer=ctx.tokenizer(options.tokenizer) if options.tokenizer else None, workers=options.workers,
                   base_dir=str(pipe_path.parent), log=ctx.log, executor=options.executor,
                   ray_address=options.ray_address)
    return out
