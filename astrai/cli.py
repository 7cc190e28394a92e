"""The `astrai` command line. Every verb takes `--set dotted.key=value` overrides (typed as YAML).

Options live in astrai.config (one declaration each); this module only maps verbs to functions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from astrai import __version__
from astrai.config import (
    ConfigError, Pipeline, Recipe, Section, Source, load_any, load_pipeline, model_help,
)

NOT_LANDED = {
    "train": "training (pretrain/SFT/DPO/GRPO) has not landed yet",
}


def _add_set(p: argparse.ArgumentParser):
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set preprocessing.max_seq_len=4096 (repeatable; "
                        "values are typed as YAML)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="astrai",
        description="Exact, packed, loss-masked LLM training data from a YAML pipeline.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"astrai {__version__}")
    sub = ap.add_subparsers(dest="verb", metavar="VERB")
    pipeline_keys = ("pipeline keys (--set KEY=VALUE):\n" + "\n".join(model_help(Pipeline))
                     + "\n\nsection keys (each item of input.sections, or of input.sources.NAME.sections):\n"
                     + "\n".join(model_help(Section, "  ")) + "\n\nsource keys (input.sources.NAME):\n"
                     + "\n".join(model_help(Source, "  ")))
    recipe_keys = ("recipe keys (--set KEY=VALUE; pipeline keys as pipeline.KEY):\n" + "\n".join(model_help(Recipe)))

    p = sub.add_parser("run", help="run a recipe: preprocess (then train/eval when they land)",
                       epilog=recipe_keys, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/sft.yaml")
    _add_set(p)

    p = sub.add_parser("preprocess", help="records -> Parquet shards with exact labels",
                       epilog=pipeline_keys, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pipeline", help="pipeline YAML")
    p.add_argument("-i", "--input", dest="inputs", action="append", required=True, metavar="INPUT",
                   help="input file, glob or saved HF dataset dir (repeatable)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory (overrides the pipeline's) [default: "
                                                     "the pipeline's tokenizer]")
    p.add_argument("--workers", type=int, default=None, help="worker processes [default: number of cores]")
    _add_set(p)

    p = sub.add_parser("validate", help="check a pipeline or recipe; print OK or every problem (exit 1)")
    p.add_argument("file", help="pipeline or recipe YAML")
    _add_set(p)

    p = sub.add_parser("inspect", help="show exactly which tokens are trained, before training",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    from astrai.data import inspect as inspect_mod

    inspect_mod.add_arguments(p)
    _add_set(p)

    p = sub.add_parser("export", help="export a preprocessed directory to a HF dataset, readable JSONL or Parquet")
    p.add_argument("out", help="preprocessed output directory (holds manifest.json)")
    p.add_argument("--to", required=True, choices=["hf", "jsonl", "parquet"],
                   help="hf: save_to_disk dir; jsonl: rows with decoded text; parquet: re-sharded")
    p.add_argument("dest", help="destination path (must not exist)")
    p.add_argument("--rows-per-shard", type=int, default=100_000, help="parquet: rows per file [default: 100000]")
    p.add_argument("--tokenizer", default=None, help="jsonl: tokenizer for decoding [default: the manifest's]")
    _add_set(p)

    p = sub.add_parser("generate", help="continue text (--prompt) or answer conversations (--chat) with a checkpoint")
    from astrai.infer import generate as generate_mod

    generate_mod.add_arguments(p)
    _add_set(p)

    p = sub.add_parser("eval", help="perplexity on held-out preprocessed data + sample generations -> eval.json")
    from astrai.infer import eval as eval_mod

    eval_mod.add_arguments(p)
    _add_set(p)

    for verb, why in NOT_LANDED.items():
        p = sub.add_parser(verb, help=f"({why})")
        p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
        _add_set(p)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.verb:
        ap.print_help()
        return 2
    try:
        return _dispatch(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from astrai.data.errors import InputError, RecordError

        if isinstance(e, (InputError, RecordError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


def _dispatch(args) -> int:
    if args.verb in NOT_LANDED:
        print(f"astrai {args.verb}: {NOT_LANDED[args.verb]} in this version.", file=sys.stderr)
        return 2
    if args.verb == "generate":
        from astrai.infer.generate import run

        return run(args)
    if args.verb == "eval":
        from astrai.infer.eval import run

        return run(args)
    if args.verb == "validate":
        return _validate(args)
    if args.verb == "preprocess":
        return _preprocess(args)
    if args.verb == "run":
        return _run(args)
    if args.verb == "inspect":
        from astrai.data import inspect as inspect_mod

        return inspect_mod.run(args)
    if args.verb == "export":
        from astrai.data.export import export

        if args.overrides:
            print("astrai export: --set has no effect here (export has no config keys)", file=sys.stderr)
            return 2

        n = export(args.out, args.to, args.dest, args.rows_per_shard, args.tokenizer)
        print(f"exported {n} rows to {args.dest} ({args.to})")
        return 0
    raise AssertionError(args.verb)


def _validate(args) -> int:
    try:
        load_any(args.file, tuple(args.overrides))
    except ConfigError as e:
        for p in e.problems:
            print(f"{e.file}:{p}")
        print(f"{len(e.problems)} problem(s)")
        return 1
    print(f"{args.file}: OK")
    return 0


def _preprocess(args) -> int:
    from astrai.data.preprocess import run_preprocess

    pipeline = load_pipeline(args.pipeline, tuple(args.overrides))
    t0 = time.time()
    tok = args.tokenizer
    if tok and not tok.startswith("package:"):
        tok = str(Path(tok).resolve())  # a path given on the command line is relative to the working directory
    run_preprocess(pipeline, args.inputs, args.output, tokenizer=tok, workers=args.workers,
                   base_dir=str(Path(args.pipeline).parent))
    print(f"done in {time.time() - t0:.1f}s")
    return 0


def _run(args) -> int:
    from astrai.data.preprocess import run_preprocess

    cfg = load_any(args.recipe, tuple(args.overrides))
    if cfg.recipe is None:
        print(f"error: {args.recipe} is a pipeline, not a recipe (use astrai preprocess)", file=sys.stderr)
        return 1
    stage = cfg.recipe.preprocess
    out = cfg.recipe_path(stage.output)
    t0 = time.time()
    print(f"[preprocess] {cfg.pipeline_path} -> {out}")
    run_preprocess(cfg.pipeline, [cfg.recipe_path(i) for i in stage.inputs], out, tokenizer=cfg.recipe_tokenizer,
                   workers=stage.workers, base_dir=str(cfg.pipeline_path.parent))
    print(f"[preprocess] done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
