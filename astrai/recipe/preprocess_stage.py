"""The preprocess stage inside a recipe: a pipeline run on the recipe's inputs, with a held-out split.

Output (RUN/<stage>/output/):
    train/      the preprocess output of the kept records (manifest.json, stats.json, data/*.parquet)
    val/        the same for the held-out records, when `holdout` > 0

The split is by position, never random, and made while reading the user's own files (nothing is
copied, and every reject names the user's file and line): position i (0-based over the input
files in order: a JSONL line, a row, a list element) is held out when floor((i + 1) * holdout) >
floor(i * holdout), which spreads the held-out records evenly (holdout 0.1 -> positions 9, 19,
29, ...). Same inputs, same split (astrai.data.holdout).

What the stage will produce is known from its options before any work (`describe_preprocess`):
the data kind (labels | text | dpo | grpo, the names the train stage uses), whether rows are packed,
and which tokenizer made them, so a train or eval stage can refuse the wrong data up front.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astrai.config.loading import get_in, raise_combination_problems
from astrai.config.pipeline import InputFormat

TRAIN, VAL = "train", "val"


class PreprocessOptions(BaseModel):
    """Options of a recipe's `preprocess` stage (paths relative to the recipe file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: str = Field(description="pipeline YAML path")
    inputs: list[str] = Field(description="input files or globs")
    format: Optional[InputFormat] = Field(
        None, description="read the inputs as this chat format instead of the pipeline's input: messages | "
                          "sharegpt | alpaca | prompt_completion (rendered with the pipeline's chat_template)")
    tokenizer: Optional[str] = Field(None, description="a tokenizer stage's name, an HF tokenizer dir or "
                                                       "package:NAME; default: the pipeline's")
    overrides: list[str] = Field(default_factory=list, description="pipeline overrides, as --set key=value")
    holdout: float = Field(0.0, ge=0.0, lt=1.0, description="share of records held out as val/ (by position)")
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
    def combination_problems(cls, data) -> list[tuple[tuple, str]]:
        if get_in(data, "ray_address") is not None and get_in(data, "executor", default="local") != "ray":
            return [(("ray_address",), "ray_address is only used with executor: ray (set it, or remove ray_address)")]
        return []


def data_dirs(output: Path) -> tuple[Path, Optional[Path]]:
    """(train dir, val dir or None) of a preprocess stage's output."""
    output = Path(output)
    val = output / VAL
    return output / TRAIN, (val if (val / "manifest.json").exists() else None)


def load_stage_pipeline(options: PreprocessOptions, base_dir: Path):
    from astrai.config.pipeline import load_pipeline

    return load_pipeline(base_dir / options.pipeline, tuple(options.overrides), input_format=options.format)


def data_kind(pipeline) -> str:
    """labels | text | dpo | grpo: what the rows will be (the same names as astrai.train.data)."""
    sources = pipeline.input.sources
    if sources:
        return "grpo" if any(s.list_field for s in sources.values()) else "dpo"
    trained_only = all(not s.template and s.action in ("train", "value") for s in pipeline.input.single_sections)
    return "text" if trained_only else "labels"


def describe_preprocess(options: PreprocessOptions, base_dir: Path, upstream: dict) -> dict:
    pipeline = load_stage_pipeline(options, base_dir)
    tok = upstream.get("tokenizer")
    pipe_dir = (base_dir / options.pipeline).parent
    if tok and tok.get("checkpoint"):  # a checkpoint stage: named as the checkpoint names its own tokenizer
        tokenizer = tok.get("tokenizer")
    elif tok:
        tokenizer = f"stage:{tok['stage']}" if "stage" in tok else tok.get("path")
    else:
        tokenizer = pipeline.tokenizer
    out = {"data_kind": data_kind(pipeline), "packed": pipeline.preprocessing.packing_strategy != "none",
           "tokenizer": tokenizer, "held_out": options.holdout > 0}
    if pipeline.template_spec is not None:  # what it renders with (astrai.recipe.template_check)
        loadable = tokenizer if tok or not tokenizer or tokenizer.startswith("package:") else str(pipe_dir / tokenizer)
        out.update(template={"spec": pipeline.template_spec, "tokenizer": loadable, "dir": str(pipe_dir)},
                   template_mismatch=pipeline.chat_template_mismatch,
                   template_kwargs=dict(pipeline.input.template_kwargs),
                   template_checked=tokenizer_checkpoint(upstream))  # compared by check_preprocess
    return out


def tokenizer_checkpoint(upstream: dict) -> Optional[dict]:
    """The template description of the checkpoint the stage's tokenizer comes from (a checkpoint stage,
    or a checkpoint directory given as the tokenizer), else None."""
    from astrai.recipe.template_check import checkpoint_template

    tok = upstream.get("tokenizer") or {}
    if tok.get("checkpoint"):
        return checkpoint_template(tok["tokenizer"])
    if tok.get("path") and (Path(tok["path"]) / "config.json").is_file():
        return checkpoint_template(tok["path"])
    return None


def check_preprocess(options: PreprocessOptions, base_dir: Path, upstream: dict) -> list[tuple[str, str]]:
    """The pipeline itself is valid (its own located problems), a tokenizer is named somewhere, and a
    checkpoint's tokenizer comes with the template the data is rendered with (or the pipeline allows another)."""
    from astrai.config.loading import ConfigError
    from astrai.recipe.template_check import drift_problem

    try:
        pipeline = load_stage_pipeline(options, base_dir)
    except ConfigError as e:
        return [("pipeline", f"{e.file}:{p}") for p in e.problems]
    if options.tokenizer is None and not pipeline.tokenizer:
        return [("tokenizer", "the pipeline names no tokenizer; set tokenizer: to a tokenizer stage or a directory")]
    tok = upstream.get("tokenizer") or {}
    if tok.get("produces") == "model" and "checkpoint" not in tok and "path" not in tok:
        return [("tokenizer", f"'{options.tokenizer}' is a train stage; name a tokenizer or checkpoint stage, or a "
                              f"tokenizer directory")]
    drift = drift_problem(describe_preprocess(options, base_dir, upstream), tokenizer_checkpoint(upstream))
    return [("pipeline", drift)] if drift else []


def preprocess_extra(options: PreprocessOptions, base_dir: Path) -> dict:
    """What the pipeline names and the options do not carry: the pipeline's own tokenizer files and
    its chat template file (a tokenizer given by the stage is fingerprinted as a reference)."""
    from astrai.text.tokenizer import TOKENIZER_FILES, resolve_tokenizer_path
    from astrai.recipe.fingerprint import path_digest

    pipeline = load_stage_pipeline(options, base_dir)
    pipe_dir = (base_dir / options.pipeline).parent
    out = {}
    if options.tokenizer is None and pipeline.tokenizer:
        tok_dir = resolve_tokenizer_path(pipeline.tokenizer, pipe_dir)
        out["tokenizer"] = {n: path_digest(tok_dir / n) for n in TOKENIZER_FILES if (tok_dir / n).exists()}
    template = pipeline.template_spec
    if template and template != "tokenizer":
        from astrai.text.template import bundled_templates

        path = bundled_templates().get(template) or pipe_dir / template  # bundled files are not .py code
        if path.is_file():
            out["chat_template"] = path_digest(path)
    return out


def run_preprocess_stage(ctx) -> dict:
    from astrai.data.holdout import Holdout
    from astrai.data.preprocess import run_preprocess

    opts: PreprocessOptions = ctx.options
    pipeline = load_stage_pipeline(opts, ctx.base_dir)
    inputs = [p if os.path.isabs(p) else str(ctx.base_dir / p) for p in opts.inputs]
    tokenizer = str(ctx.inputs["tokenizer"]) if "tokenizer" in ctx.inputs else None
    pipe_dir = str((ctx.base_dir / opts.pipeline).parent)
    sides = [TRAIN, VAL] if opts.holdout > 0 else [TRAIN]
    metrics = {}
    for side in sides:
        holdout = Holdout(opts.holdout, side) if opts.holdout > 0 else None
        stats = run_preprocess(pipeline, inputs, str(ctx.output / side), tokenizer=tokenizer, workers=opts.workers,
                               base_dir=pipe_dir, log=ctx.log, executor=opts.executor, ray_address=opts.ray_address,
                               holdout=holdout)
        prefix = "" if side == TRAIN else "val_"
        for key in ("records_read", "records_kept", "records_filtered", "records_rejected", "rows", "tokens",
                    "trained_tokens"):
            if key in stats:
                metrics[prefix + key] = stats[key]
        if side == TRAIN and stats.get("packing_efficiency") is not None:
            metrics["packing_efficiency"] = stats["packing_efficiency"]
    if opts.holdout > 0:
        ctx.log(f"held out {metrics['val_records_read']} of {metrics['records_read'] + metrics['val_records_read']} "
                f"records for validation")
    return metrics
