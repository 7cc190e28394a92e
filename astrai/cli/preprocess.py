"""`astrai preprocess PIPELINE -i INPUT... -o OUT`: records -> Parquet shards with exact labels."""

from __future__ import annotations

import sys
import time

from astrai.config import Pipeline, Section, Source, load_any, model_help


# finished units of work are kept (completion markers, checkpoints); what was half-written is redone
INTERRUPTED = "interrupted; rerun to resume"

def help_for(verb: str) -> str:
    return "records -> Parquet shards with exact labels"


def add_arguments(p):
    p.epilog = ("pipeline keys (--set KEY=VALUE):\n" + "\n".join(model_help(Pipeline))
                + "\n\nsection keys (each item of input.sections, or of input.sources.NAME.sections):\n"
                + "\n".join(model_help(Section, "  ")) + "\n\nsource keys (input.sources.NAME):\n"
                + "\n".join(model_help(Source, "  ")))
    p.add_argument("pipeline", help="pipeline YAML")
    p.add_argument("-i", "--input", dest="inputs", action="append", required=True, metavar="INPUT",
                   help="input file, glob or saved HF dataset dir (repeatable)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory (overrides the pipeline's) [default: "
                                                     "the pipeline's tokenizer]")
    for name, kw in (("workers", {"type": int}), ("executor", {}), ("ray_address", {"metavar": "HOST:PORT"})):
        _stage_option(p, name, **kw)


def _stage_option(p, name: str, **kw):
    """A flag declared once, by the recipe's preprocess stage (PreprocessOptions): its default,
    choices and meaning come from the model, so `--executor` and `preprocess: {executor: ...}` agree."""
    from typing import Literal, get_args, get_origin

    from astrai.recipe.preprocess_stage import PreprocessOptions

    field = PreprocessOptions.model_fields[name]
    if get_origin(field.annotation) is Literal:
        kw["choices"] = get_args(field.annotation)
    shown = "" if field.default is None else f" [default: {field.default}]"  # else the description says it
    p.add_argument("--" + name.replace("_", "-"), default=field.default, help=field.description + shown, **kw)


def run(args) -> int:
    from astrai.data.preprocess import run_preprocess

    cfg = load_any(args.pipeline, tuple(args.overrides))
    if cfg.is_recipe:
        print(f"error: {args.pipeline} is a recipe, not a pipeline (use astrai run)", file=sys.stderr)
        return 1
    if args.ray_address is not None and args.executor != "ray":
        print("error: --ray-address is only used with --executor ray", file=sys.stderr)
        return 2
    t0 = time.time()
    run_preprocess(cfg.pipeline, args.inputs, args.output, tokenizer=cfg.tokenizer(args.tokenizer),
                   workers=args.workers, base_dir=cfg.base_dir, executor=args.executor, ray_address=args.ray_address)
    print(f"done in {time.time() - t0:.1f}s")
    return 0
