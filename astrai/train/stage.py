"""The train stage as a recipe runs it: its `train:` block with paths relative to the recipe; the
data defaults to what the recipe's preprocess stage wrote. Returns the final model directory."""

from __future__ import annotations

from astrai.config.stages import StageContext
from astrai.config.train import TrainOptions
from astrai.train.run import TrainConfigError, run_train


def run(options: TrainOptions, ctx: StageContext) -> str:
    data = ctx.path(options.data) if options.data else ctx.outputs.get("preprocess")
    if data is None:
        raise TrainConfigError("train: no data (set train.data, or declare a preprocess stage before it)")
    fixed = {"data": data, "output": ctx.path(options.output)}
    for key in ("val_data", "ref_model"):
        if getattr(options, key):
            fixed[key] = ctx.path(getattr(options, key))
    if "/" in options.model or options.model.endswith(".json"):  # else a size preset name
        fixed["model"] = ctx.path(options.model)
    result = run_train(options.model_copy(update=fixed))
    ctx.log(f"train: {result['steps']} steps, loss {result['loss']}, final model {result['final']}")
    return result["final"] or result["output"]
