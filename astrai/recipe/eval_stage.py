"""The eval stage inside a recipe: held-out figures and sample generations, via run_eval.

Options are astrai.infer's EvalOptions, except that the recipe decides the paths: `model` names a
train stage (its final checkpoint, or its LoRA adapter merged into the base it names; a checkpoint
directory may be given instead), `data` names a preprocess stage and `split` picks its val/
(default) or train/ split; `ref_model` (DPO pairs) names the stage DPO started from; eval.json goes
to RUN/<stage>/output/. The figures follow the data: perplexity on single-output rows, the held-out
reward accuracy and margin on DPO pairs, the policy-weighted reward on scored groups
(astrai.infer.preference). Checked before any work: the split exists (the data stage holds records
out), DPO pairs have a reference model, and the model was trained on data made with the same
tokenizer as the data evaluated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from astrai.infer.eval import EvalOptions


class EvalStageOptions(EvalOptions):
    model: str = Field(description="the train stage to evaluate (its final checkpoint), or a checkpoint dir")
    data: str = Field(description="the preprocess stage whose split is evaluated")
    split: Literal["val", "train"] = Field("val", description="which split of the data stage")
    ref_model: Optional[str] = Field(None, description="DPO data: the stage DPO started from (its final checkpoint), "
                                     "or a checkpoint dir: the reference of the reward figures")
    checkpoint: str = Field("", description="set by the recipe from `model`")

    @model_validator(mode="after")
    def _paths_from_recipe(self):
        if self.checkpoint or self.output:
            raise ValueError("checkpoint and output are decided by the recipe (model: a train stage; "
                             "RUN/<stage>/output); remove them")
        return self


def check_eval(options: EvalStageOptions, base_dir: Path, upstream: dict) -> list[tuple[str, str]]:
    problems = []
    data = upstream.get("data") or {}
    model = upstream.get("model") or {}
    if options.split == "val" and data.get("held_out") is False:  # absent: that stage has its own problem
        problems.append(("data", f"'{options.data}' holds no records out: set holdout (e.g. 0.1) in that stage, "
                                 f"or split: train to evaluate on training data"))
    if data.get("data_kind") == "dpo" and options.ref_model is None:
        problems.append(("ref_model", f"'{options.data}' makes DPO pairs: their held-out reward figures need the "
                                      f"reference model; set ref_model to the stage DPO started from"))
    if options.ref_model is not None and data.get("data_kind") not in (None, "dpo"):
        problems.append(("ref_model", f"ref_model is only used on DPO pairs, and '{options.data}' makes "
                                      f"{data['data_kind']} data; remove it"))
    if model.get("tokenizer") and data.get("tokenizer") and model["tokenizer"] != data["tokenizer"]:
        problems.append(("data", f"'{options.model}' was trained with tokenizer {model['tokenizer']} but "
                                 f"'{options.data}' was preprocessed with {data['tokenizer']}; preprocess the "
                                 f"evaluation data with the model's tokenizer"))
    return problems


def _final(output: Path) -> Path:
    """A train stage's final checkpoint (a full one, or a LoRA adapter), or the path as given."""
    final = output / "final"
    return final if (final / "config.json").exists() or (final / "adapter_config.json").exists() else output


def run_eval_stage(ctx) -> dict:
    from astrai.infer.eval import run_eval
    from astrai.recipe.preprocess_stage import TRAIN, data_dirs

    opts: EvalStageOptions = ctx.options
    model = Path(ctx.inputs["model"])
    checkpoint = _final(model)
    train_dir, val_dir = data_dirs(ctx.inputs["data"])
    data = train_dir if opts.split == TRAIN else val_dir
    if data is None:
        raise ValueError(f"{ctx.inputs['data']} has no val/ split")
    fields = {k: v for k, v in opts.model_dump().items() if k not in ("model", "data", "split", "checkpoint",
                                                                      "output", "ref_model")}
    ref = None
    if "ref_model" in ctx.inputs:
        ref = _final(Path(ctx.inputs["ref_model"]))
    options = EvalOptions(**fields, checkpoint=str(checkpoint), data=str(data), ref_model=str(ref) if ref else None,
                          output=str(ctx.output / "eval.json"))

    class _Log:  # run_eval writes its summary lines to a stream: send them to the stage log
        def write(self, text: str):
            for line in text.rstrip("\n").splitlines():
                ctx.log(line[len("[eval] "):] if line.startswith("[eval] ") else line)

    result = run_eval(options, out=_Log())
    keys = ("perplexity", "loss", "trained_tokens", "documents", "reward_accuracy", "reward_margin", "reward_chosen",
            "reward_rejected", "pairs", "policy_reward", "policy_accuracy", "reward_mean", "groups")
    return {key: result[key] for key in keys if key in result} | {"samples": len(result.get("samples") or [])}
