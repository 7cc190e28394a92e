"""The train stage inside a recipe: `run_train` on a preprocess stage's output, resumable.

Options are astrai.train's TrainOptions (one declaration), except that the recipe decides the
paths: `data` names a preprocess stage (its train/ split is trained on, its val/ split, when it
holds one out, is the validation data), `output` is RUN/<stage>/output, and `val_data` may name
another preprocess stage. Checked before any work: the strategy fits the data kind (sft needs
labels, dpo/grpo their own records), and eval_every has validation data to use.

Killed or interrupted, the stage is rerun by `astrai run` in the same output directory, and
run_train continues from its last checkpoint (resume: auto); the final loss equals an
uninterrupted run's because checkpoints carry the optimizer, scheduler, RNG and sampler state.
A finished stage whose max_steps or epochs grew (nothing else changed) is continued the same way
from a copy of its output (`continues_train`); its product, stamped for "up to date", is final/.
The validation figures (the loss, and for DPO/GRPO the held-out reward figures) are measured
before the first step too (astrai.train.callbacks.Metrics), so the table can say how training
moved them; the stage reports `loss_curve` (astrai.plot's panels) for the run directory's loss.png.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field

from astrai.config.loading import get_in
from astrai.config.train import TrainOptions

RECIPE_SET = ("output",)  # fields the recipe fills in


class TrainStageOptions(TrainOptions):
    data: str = Field(description="the preprocess stage to train on (its train/ split)")
    model: str = Field("tiny", description="a size preset (tiny, small, ...), an earlier train stage (continue "
                                           "from its final checkpoint), a config.json or a checkpoint dir")
    output: str = Field("", description="set by the recipe: RUN/<stage>/output")
    val_data: Optional[str] = Field(
        None, description="a preprocess stage whose val/ split validates; default: the data stage's own val/")

    val_data_from_data_stage = True  # check_train decides, with the data stage's facts

    @classmethod
    def combination_problems(cls, data) -> list[tuple[tuple, str]]:
        # TrainOptions' checks (betas, lora, rewards, ...), and the output the recipe decides; TrainOptions'
        # validator raises them for a valid-typed stage as for `astrai train`
        p = super().combination_problems(data)
        if get_in(data, "output"):
            p.insert(0, (("output",), "output is decided by the recipe (RUN/<stage>/output); remove it"))
        return p


STRATEGY_DATA = {"sft": ("labels",), "seq": ("labels", "text"), "dpo": ("dpo",), "grpo": ("grpo",)}


def check_train(options: TrainStageOptions, base_dir: Path, upstream: dict) -> list[tuple[str, str]]:
    problems = []
    data = upstream.get("data") or {}
    kind = data.get("data_kind")
    online = options.rollout is not None  # online grpo trains on prompts: single-output rows
    if kind is not None and kind not in (("labels", "text") if online else STRATEGY_DATA[options.strategy]):
        fix = {"text": "use strategy: seq for plain text, or a pipeline with mask rules",
               "dpo": "use strategy: dpo", "grpo": "use strategy: grpo",
               "labels": "use strategy: sft (or a pipeline with sources for dpo/grpo)"}[kind]
        problems.append(("data", f"strategy {options.strategy} cannot train on '{options.data}', which makes "
                                 f"{kind} data; {fix}"))
    val = upstream.get("val_data") or data
    # `held_out` absent: the data stage has a problem of its own and is not described; say nothing
    if options.eval_every is not None and val.get("held_out") is False:
        problems.append(("eval_every", f"validation needs held-out data: set holdout (e.g. 0.1) in stage "
                                       f"'{options.val_data or options.data}', or remove eval_every"))
    if options.lora is not None and "model" not in upstream:
        problems.append(("model", f"lora trains adapters on a pretrained checkpoint, but '{options.model}' is a "
                                  f"size preset (random weights); name a checkpoint directory or stage"))
    base = (upstream.get("model") or {}).get("tokenizer")
    if base and data.get("tokenizer") and base != data["tokenizer"]:
        problems.append(("data", f"'{options.data}' was preprocessed with tokenizer {data['tokenizer']}, but "
                                 f"'{options.model}' was trained with {base}; preprocess with the model's tokenizer"))
    if options.val_data and (upstream.get("val_data") or {}).get("tokenizer") != data.get("tokenizer"):
        problems.append(("val_data", f"'{options.val_data}' was preprocessed with another tokenizer than "
                                     f"'{options.data}'; use the same tokenizer for both"))
    from astrai.train.report import check_reporters  # a missing tracker: refused here, not when training starts

    problems += [("report_to", p) for p in check_reporters(options.reporters)]
    drift = _template_drift(options, data, upstream.get("model") or {})
    if drift:
        problems.append(("data", f"'{options.data}' and '{options.model}': {drift}"))
    return problems


def _template_drift(options: TrainStageOptions, data: dict, model: dict):
    """The data's template against the one the model serves with (astrai.recipe.template_check); a
    checkpoint the data's own tokenizer came from was compared by the preprocess stage already."""
    from astrai.recipe.template_check import checkpoint_template, drift_problem

    served = model.get("template")
    if served is None and model.get("path") and (Path(model["path"]) / "tokenizer.json").is_file():
        served = checkpoint_template(model["path"])  # a checkpoint directory given as the model
    if served is None or served == data.get("template_checked"):
        return None
    return drift_problem(data, served)


GROWABLE = ("max_steps", "epochs")


def continues_train(old: dict, new: TrainStageOptions) -> bool:
    """A finished run can be continued (from its last checkpoint, as `astrai train` resumes) when
    max_steps or epochs grew and nothing else changed (the runner compares everything else): a
    shorter run, or resume: never, starts over. max_steps null is unbounded."""
    if new.resume != "auto" or not isinstance(old.get("epochs"), int):
        return False
    before, after = old.get("max_steps"), new.max_steps
    steps_grew = after is None or (before is not None and after >= before)
    return steps_grew and new.epochs >= old["epochs"] and (before, old["epochs"]) != (after, new.epochs)


def describe_train(options: TrainStageOptions, base_dir: Path, upstream: dict) -> dict:
    data = upstream.get("data") or {}
    # the checkpoint it writes carries its data's template (astrai.train.data.TrainData.write_tokenizer)
    return {"tokenizer": data.get("tokenizer"), "strategy": options.strategy, "data_kind": data.get("data_kind"),
            "template": data.get("template")}


def run_train_stage(ctx) -> dict:
    from astrai.recipe.preprocess_stage import data_dirs
    from astrai.train.run import run_train

    opts: TrainStageOptions = ctx.options
    train_dir, own_val = data_dirs(ctx.inputs["data"])
    val_dir = data_dirs(ctx.inputs["val_data"])[1] if "val_data" in ctx.inputs else own_val
    fields = {k: v for k, v in opts.model_dump().items() if k not in ("data", "output", "val_data")}
    if "model" in ctx.inputs:  # an earlier train stage (its final checkpoint) or a path
        fields["model"] = str(continued_from(Path(ctx.inputs["model"])))
    options = TrainOptions(**fields, data=str(train_dir), output=str(ctx.output),
                           val_data=str(val_dir) if val_dir else None)
    options = options.with_reward_files_under(ctx.base_dir)
    metrics_file = ctx.output / "metrics.jsonl"
    ctx.log(f"training {options.model} ({options.strategy}) on {train_dir}" + (f", validating on {val_dir}"
                                                                                 if val_dir else ""))
    if options.rollout is not None:
        from astrai.rl.online import run_online_grpo

        result = run_online_grpo(options)
    else:
        result = run_train(options)
    if result.get("stopped") is not None:
        # a signal stopped training after a checkpoint: not done; `astrai run` again resumes it
        raise KeyboardInterrupt(f"training stopped by signal {result['stopped']} at step {result['steps']}")
    return train_metrics(result, metrics_file, options.strategy, online=options.rollout is not None)


def continued_from(model: Path) -> Path:
    """What a train stage starts from when `model` names an earlier train stage: its final checkpoint;
    after a LoRA stage, the merged one (final/merged/), else its adapter (merged into its base on load)."""
    final = model / "final"
    if (final / "merged" / "config.json").exists():
        return final / "merged"
    if (final / "config.json").exists() or (final / "adapter_config.json").exists():
        return final
    return model


def train_metrics(result: dict, metrics_file: Path, strategy: str = "sft", online: bool = False) -> dict:
    """The stage's key figures (first and last of each validation figure; the drop of val_loss; for
    online GRPO the mean reward of the first and the last 20% of the steps, and with held-out prompts
    their sampled mean reward, val_reward_mean) and its curves for the
    run's loss.png (astrai.plot). GRPO's validation loss is left out of the figures: with the old
    policy equal to the current one it is -sum(advantage * tokens) plus the KL, which says nothing
    about learning (its held-out policy-weighted reward does)."""
    from astrai.plot import curves
    from astrai.train.summary import figures, read_records

    records = read_records(metrics_file)
    f = figures(records)
    out = {"steps": result.get("steps"), "train_loss": f.get("loss", result.get("loss")),
           "val_loss": result.get("val_loss"), "checkpoint": result.get("final")}
    if strategy == "grpo":  # offline, val_reward_mean is the held-out data's own: the same at every evaluation
        left_out = ("val_loss",) if online else ("val_loss", "val_reward_mean", "val_reward_std")
        f = {k: v for k, v in f.items() if not k.startswith(left_out)}
        out["val_loss"] = None
    out |= {k: v for k, v in f.items() if k.startswith("val_")}
    if "val_loss" in f:
        out["val_loss_drop"] = f["val_loss_start"] - f["val_loss"]
    # a resumed run may have logged a step twice (after its last checkpoint): keep the latest record
    reward = sorted({r["step"]: r["reward_mean"] for r in records if r.get("reward_mean") is not None}.items())
    if online and reward:  # sampled by the policy itself, its rewards show learning (offline: the data's)
        fifth = max(1, len(reward) // 5)  # the mean reward of the first and the last 20% of the steps
        out["reward_first"] = sum(v for _, v in reward[:fifth]) / fifth
        out["reward_last"] = sum(v for _, v in reward[-fifth:]) / fifth
        out["reward_rise"] = out["reward_last"] - out["reward_first"]
    out["loss_curve"] = curves(records)
    return out
